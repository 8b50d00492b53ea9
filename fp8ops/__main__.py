"""``python -m fp8ops ...`` is the ``fp8ops`` command."""

from fp8ops.cli import main

main()
