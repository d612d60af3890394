"""Where a run's curves go besides log.jsonl: TensorBoard (train.tensorboard) and Weights & Biases (train.wandb).

Each board takes every row train.py writes to log.jsonl (add) and is closed at the end of the session. Both are
off unless asked for: a run should not change what it writes because a package happens to be installed.

    tensorboard --logdir runs
    python train.py --config configs/88m.toml --wandb --wandb-project my-project   # WANDB_MODE=offline: no network
"""

import importlib.util
import secrets
from pathlib import Path

TENSORBOARD_MISSING = ("train.tensorboard needs the tensorboard package: pip install tensorboard (or pip install "
                       "-e '.[tensorboard]'), or leave out --tensorboard")
WANDB_MISSING = ("train.wandb needs the wandb package: pip install wandb (or pip install -e '.[wandb]'), or leave "
                 "out --wandb")
WANDB_ID = "wandb_id"  # the run folder's file naming its W&B run, so that --resume continues the same one


def check_installed(tcfg):
    """Before a run starts: a board asked for whose package is missing, in one line."""
    if tcfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(TENSORBOARD_MISSING)
    if tcfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError(WANDB_MISSING)


def numbers(row: dict) -> dict:
    """A log row's curves: each number under train/ (a step row) or val/ (an evaluation), each group's learning
    rate under lr/; the step itself, the skipped-step count and flags are not curves."""
    section = "val" if any(k.startswith("val_") for k in row) else "train"
    out = {}
    for key, value in row.items():
        if key not in ("step", "skipped") and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{section}/{key}"] = value
        elif key == "lrs":
            out.update({f"lr/{role}": lr for role, lr in value.items()})
    return out


class TensorBoard:
    """Under <run>/tensorboard. A run resumed at step T purges what an earlier session logged after T
    (purge_step T + 1: the evaluation at T itself is not run again), so each step is drawn once, from the
    session that trained it last."""

    def __init__(self, run_dir: Path, resumed_at: int | None):
        from torch.utils.tensorboard import SummaryWriter  # installed: check_installed said so
        self.writer = SummaryWriter(str(run_dir / "tensorboard"),
                                    purge_step=None if resumed_at is None else resumed_at + 1)

    def add(self, row: dict):
        for name, value in numbers(row).items():
            self.writer.add_scalar(name, value, row["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandB:
    """One W&B run per run folder: its project is train.wandb_project, its name the folder's, its config the
    run's whole config. A fresh start makes a new W&B run (its id in <run>/wandb_id); --resume continues that
    one. W&B keeps each step's first value, so steps a crashed session logged after its last checkpoint keep
    that session's values (log.jsonl and TensorBoard keep the resumed session's)."""

    def __init__(self, run_dir: Path, resumed_at: int | None, project: str, config: dict):
        import wandb  # installed: check_installed said so
        id_file = run_dir / WANDB_ID
        if resumed_at is None or not id_file.exists():
            id_file.write_text(secrets.token_hex(4) + "\n")
        self.run = wandb.init(project=project, name=run_dir.name, id=id_file.read_text().strip(), resume="allow",
                              dir=str(run_dir), config=config)

    def add(self, row: dict):
        self.run.log(numbers(row), step=row["step"])

    def close(self):
        self.run.finish()


def open_boards(tcfg, run_dir: Path, resumed_at: int | None, config: dict) -> list:
    """The boards the run's [train] section asks for (rank 0 only: the caller decides)."""
    boards = [TensorBoard(run_dir, resumed_at)] if tcfg.tensorboard else []
    if tcfg.wandb:
        boards.append(WandB(run_dir, resumed_at, tcfg.wandb_project, config))
    return boards
