"""Human-readable output: logging to the console and ``run.dir/train.log``, and a progress bar with
ETA on rank 0 only (other ranks log warnings and errors only, so the console stays readable)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm import tqdm


def setup_logging(run_dir: Path, rank: int) -> None:
    root = logging.getLogger("seektrain")
    root.handlers.clear()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(run_dir / "train.log")
        file.setFormatter(fmt)
        root.addHandler(file)
    root.propagate = False


class Progress:
    """tqdm bar on stderr; log lines go through ``write`` so they do not tear the bar."""

    def __init__(self, start: int, total: int, enabled: bool):
        self.bar = tqdm(
            total=total,
            initial=start,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=1.0,
            disable=not enabled,
        )
        self.log = logging.getLogger("seektrain.train")

    def advance(self, step: int) -> None:
        """``step`` is done (its loss may not be known yet)."""
        self.bar.update(step - self.bar.n)

    def show(self, metrics: dict) -> None:
        """The latest logged step's loss, beside the bar."""
        self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)

    def write(self, line: str) -> None:
        if self.bar.disable:
            self.log.info(line)
        else:
            with self.bar.external_write_mode():
                self.log.info(line)

    def close(self) -> None:
        self.bar.close()
