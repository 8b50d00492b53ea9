"""Helpers the test modules share (imported as ``support.<module>``: pytest puts ``tests/`` on
``sys.path``, and so does a test file run as a script under torchrun).

* ``small_model``: the small model's manifest changes, ``write_derived`` and the small fine-tuning
  manifest;
* ``shared_base``: the small base model, pre-trained once and cached on disk (the ``small_base``
  fixture of ``tests/conftest.py``);
* ``checkpoint_surgery``: edits to a saved checkpoint's metadata and hash list;
* ``example_manifests``: the repository's example manifests and a minimal valid one;
* ``ci_scripts``: a script under ``ci/`` loaded as a module;
* ``gemm_log``: a dispatch mode recording the GEMMs that reach torch's kernels;
* ``megatron_specs``: Megatron layer specs in the shapes of other megatron-core releases;
* ``te_stand_in``: a stand-in for a Transformer Engine linear's FP8 bookkeeping;
* ``te_update_oracle``: the independent scalar oracle of TE's delayed-scaling update;
* ``nvfp4_oracle``: the independent numpy oracle of TE's NVFP4 casts;
* ``te_nvfp4_reference``: TE's own NVFP4 reference quantizer, loaded without its CUDA build;
* ``float_bounds``: how far a float64 norm summed in another order may land from itself;
* ``fifo``: a read that must refuse a FIFO rather than wait on it, guarded by a timeout.
"""
