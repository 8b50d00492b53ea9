"""Transformer Engine debug statistics logs, written by nvdlfw_inspect's own logger.

nvdlfw_inspect's logging code runs without a GPU; Transformer Engine's debug features (which
compute the values) do not. So the values come from the test, and everything else from
nvdlfw_inspect 0.2.2 as TE drives it: ``initialize_logger`` and
``make_default_statistics_logger`` (what ``debug_api.initialize`` calls for the default file
logger) make ``LOG_DIR/nvdlfw_inspect_statistics_logs/nvdlfw_inspect_globalrank-<rank>.log``,
and each value goes through ``MetricLogger.log_scalar(f"{layer}_{tensor}_{stat}", value,
iteration)``, as TE's stats buffer logs it (``_Buffer.log``). The global rank in the file's name
comes from ``torch.distributed.get_rank()``; one process writes every rank's file here, so that
call is answered with the rank being written (the one thing not as in a real run).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from unittest import mock

import pytest

# (layer, tensor, stat, value, iteration)
Entry = tuple[str, str, str, float, int]


def write_rank_log(log_dir: Path, rank: int, entries: Iterable[Entry]) -> Path:
    """One rank's statistics log, as nvdlfw_inspect writes it; returns its path."""
    nv_logging = pytest.importorskip("nvdlfw_inspect.logging")
    dist = nv_logging.dist
    with (
        mock.patch.object(dist, "is_initialized", return_value=True),
        mock.patch.object(dist, "get_rank", return_value=rank),
    ):
        nv_logging.initialize_logger(str(log_dir))
        nv_logging.make_default_statistics_logger()
    nv_logging.MetricLogger.enabled_loggers = [nv_logging.LOGGER]
    try:
        for layer, tensor, stat, value, iteration in entries:
            nv_logging.MetricLogger.log_scalar(f"{layer}_{tensor}_{stat}", value, iteration)
    finally:
        # The loggers are the process's (logging.getLogger by name): the next rank's file must
        # not receive this rank's lines, nor this file the next rank's.
        for name in ("Default Statistics", "nvdlfw_inspect"):
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                handler.close()
                logger.removeHandler(handler)
        nv_logging.MetricLogger.enabled_loggers = []
        nv_logging.LOGGER = None
    return (
        Path(log_dir) / "nvdlfw_inspect_statistics_logs" / f"nvdlfw_inspect_globalrank-{rank}.log"
    )


LAYERS = tuple(
    f"model.decoder.layers.{n}.{name}"
    for n in (1, 2)
    for name in (
        "self_attention.linear_qkv",
        "self_attention.linear_proj",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    )
)


def delayed_run(
    iterations: Iterable[int] = range(0, 40, 2), layers: tuple[str, ...] = LAYERS
) -> list[Entry]:
    """What a delayed-scaling run logs with LogTensorStats (cur_amax, mean, l2_norm) and
    LogFp8TensorStats (underflows%, overflows%, scale_inv_max, mse) on the three cast tensors,
    in the order TE logs them at each debug_api.step(): every layer's buffers, one after the
    other. Values vary with layer, tensor and iteration so that a misplaced one shows."""
    entries = []
    for iteration in iterations:
        for i, layer in enumerate(layers):
            for j, tensor in enumerate(("activation", "weight", "gradient")):
                base = 1 + i + 0.1 * j + 0.001 * iteration
                entries += [
                    (layer, tensor, "cur_amax", 2 * base, iteration),
                    (layer, tensor, "mean", 0.01 * base, iteration),
                    (layer, tensor, "l2_norm", 30 * base, iteration),
                    (layer, tensor, "underflows%", 0.5 * base, iteration),
                    (layer, tensor, "overflows%", 0.001 * base, iteration),
                    (layer, tensor, "scale_inv_max", base / 448, iteration),
                    (layer, tensor, "mse", 1e-4 * base, iteration),
                ]
    return entries
