"""Observability: metrics sinks, the per-step summary line, progress bars, library logging. A leaf anyone may use."""

from lichen.observe.metrics import MetricsLogger, format_step_line, get_logger, read_metrics
from lichen.observe.progress import print_line, progress

__all__ = ["MetricsLogger", "format_step_line", "get_logger", "print_line", "progress", "read_metrics"]
