"""Dual-track evaluation: a BF16 control, the FP8 candidate and the candidate with its high-risk
modules in BF16, trained on the same data and tokens (``tracks.py`` derives their manifests,
``run.py`` trains them); ``fp8ops compare`` judges them."""
