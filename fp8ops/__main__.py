"""``python -m fp8ops ...`` is the ``fp8ops`` command."""

from fp8ops.cli import main

# The guard matters: Megatron's checkpoint writer starts a "spawn" multiprocessing manager,
# which re-imports the main module; unguarded, that import would run the command again.
if __name__ == "__main__":
    main()
