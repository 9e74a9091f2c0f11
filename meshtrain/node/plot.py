"""Loss curves to PNG, for the demo's summary and the convergence benchmark (one plotting path).

matplotlib with the Agg backend: no display needed, nothing but a file written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_curves(curves: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, *, title: str,
                xlabel: str = "inner step", ylabel: str = "held-out loss") -> Path:
    """Write one line per named curve of (x, y) points to `path` (PNG); the legend carries each
    curve's last value. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 5.6))
    try:
        for name, points in curves.items():
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, label=f"{name} ({ys[-1]:.3f})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
