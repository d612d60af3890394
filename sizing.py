"""How long a run is: its steps from train.steps, train.tokens, or a budget of train.seconds sized from the
first steps' measured pace, and its warm-up fitted to that length. Pure functions of the config and of
measured step times; train.py calls them as the run goes (train.size_steps)."""

import numpy as np

import config as C

# train.seconds: the steps stay unsized (the schedule at its stable rate) for this many steps, whose
# times, the first two (compiling) left out, then size the run (size_steps), which sizes itself once more
# at resize_step. With a window schedule the second half of the probe runs at the last window, so that
# both ends of the schedule's cost are timed.
UNSIZED = 10**9
PROBE_STEPS = 12
# The steps fill all but this share of the seconds left when sizing: what a step will take is known to
# about 0.7% (the 126m default's pair of 2026-12-02, sized at steps 64 and 65: 0.5% faster and 0.7%
# slower than predicted over the 115 s left; the slower one overran its 157 s by 0.6 s).
SIZING_MARGIN = 0.01
# A warm-up over more than this share of the run is shortened to it (and said): `--steps 20` on a preset
# that warms up over 20 steps would otherwise end at its peak rate, never warming down.
MAX_WARMUP_SHARE = 0.5


def fitted_warmup(cfg: C.TrainConfig, steps: int, done: int = 0) -> int:
    """train.warmup_steps, or MAX_WARMUP_SHARE of `steps` where that is shorter (never fewer than the
    `done` steps already taken)."""
    return min(cfg.warmup_steps, max(done, int(MAX_WARMUP_SHARE * steps)))


def total_steps(cfg: C.TrainConfig) -> int:
    """The run's optimizer steps; UNSIZED until a train.seconds run has measured its speed. A train.tokens budget
    is the most steps whose batches (the batch schedule's) fit in it, at least one."""
    if cfg.steps > 0:
        return cfg.steps
    if not cfg.tokens:
        return UNSIZED
    steps = max(1, cfg.tokens // cfg.batch_tokens)  # as many whole batches: a growing batch's steps are no larger
    while cfg.batch_stages > 1 and run_tokens(cfg, steps + 1) <= cfg.tokens:
        steps += 1
    return steps


def batch_stage(step: int, steps: int, stages: int) -> int:
    """train.batch_stages: the stage (1 to stages) of the growing batch at `step` of `steps`, each an equal share of
    the steps; stage i trains on i/stages of train.batch_tokens at sqrt(i) times the learning rates (modded-nanogpt
    record #46: 131K, 262K, then 393K tokens, its rates 1, 1.52 and 1.73 times its first). Small batches learn the
    common patterns as well as large ones, in fewer tokens. An unsized train.seconds run probes at stage 1."""
    if stages == 1 or steps == UNSIZED:
        return 1
    return min(stages, 1 + stages * step // steps)


def step_tokens(cfg: C.TrainConfig, step: int, steps: int) -> int:
    """The tokens step `step` of `steps` trains on: its stage's share of train.batch_tokens."""
    return cfg.batch_tokens * batch_stage(step, steps, cfg.batch_stages) // cfg.batch_stages


def run_tokens(cfg: C.TrainConfig, steps: int, start: int = 0) -> int:
    """The tokens a run of `steps` steps trains on from step `start` to its end."""
    if cfg.batch_stages == 1:
        return (steps - start) * cfg.batch_tokens
    return sum(step_tokens(cfg, step, steps) for step in range(start, steps))


def step_time_fit(times: list, windows: list):
    """Seconds a step takes at a long window: the line through the median time at each window timed so
    far, least squares weighted by how many steps each median rests on; the median itself where one
    window was timed. Step cost grows linearly with the window, as attention's share of it does."""
    times, windows = np.asarray(times, dtype=np.float64), np.asarray(windows)
    seen, counts = np.unique(windows, return_counts=True)
    medians = np.array([np.median(times[windows == w]) for w in seen])
    if len(seen) == 1:
        return lambda window: float(medians[0])
    slope, intercept = np.polyfit(seen, medians, 1, w=np.sqrt(counts))
    return lambda window: float(intercept + slope * window)


def steps_to_fill(seconds: float, done: int, step_time, window, share=lambda step, steps: 1.0) -> int:
    """The most steps (at least done + 1) whose predicted times from step `done` on fit in `seconds`:
    step_time(window) from step_time_fit (a whole batch's), window(step, steps) the long window the schedule gives
    a step of a run of `steps`, share(step, steps) the share of the whole batch it trains on (the batch schedule's).
    The total grows with the steps, so a doubling then a bisection finds it."""
    def cost(steps: int) -> float:
        return sum(step_time(window(s, steps)) * share(s, steps) for s in range(done, steps))
    fits, over = done + 1, done + 2
    while cost(over) <= seconds:
        fits, over = over, done + 2 * (over - done)
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if cost(mid) <= seconds else (fits, mid)
    return fits


def resize_step(tcfg: C.TrainConfig, steps: int) -> int:
    """The step at which a train.seconds run sizes itself again: halfway through its stable share,
    where the steps since the probe show the pace a probe of ten steps misses (the card warming, the
    windows between the two it timed) and the warm-down has not begun. The 126m default overran its
    157 s by 0.9 and 1.4 s sized from the probe alone (2026-12-02)."""
    return round((1 - tcfg.warmdown_fraction) * steps / 2)


def seconds_to_fill(seconds: float, spent: float) -> float:
    """The training seconds the rest of a train.seconds run is sized to: what is left, less SIZING_MARGIN."""
    return (seconds - spent) * (1 - SIZING_MARGIN)
