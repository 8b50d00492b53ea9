"""fp8ops: auditable, observable and locally reversible FP8 fine-tuning."""

__version__ = "0.1.0"
