"""Shared pieces of the tests: where the repository and tests/ are (for the tests that start
processes), a tiny run config, a tiny real tokenizer, a controller that cycles through its
candidates, a full disk under Orbax, and the data of the plots a command saves.

Every test imports it as ``helpers`` (pyproject's ``pythonpath`` puts tests/ on the path)."""

import hashlib
import json
import os
from pathlib import Path

from sagc_jax.controller import GroupController

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository: configs/, docs/, the sagc_jax package
# PYTHONPATH of a process a test starts: the package, helpers, and sitecustomize.py (which lets
# every process of a multi-process run write the suite's compilation cache, tests/conftest.py)
PYTHONPATH = os.pathsep.join([str(ROOT), str(TESTS)])

TINY = [
    "model.preset=tiny",
    "sampling.max_new_tokens=12",
    "sampling.prompt_buckets=[16]",
    "data.max_terms=4",
    "train.prompts_per_step=2",
    "train.learning_rate=1e-3",
    "train.eval_size=4",
    "logging.progress=false",
    "controller.candidates=[2,4]",
    # one loop body per sampler program: the trainer tests compile fewer (tokens do not depend
    # on it; tests/sampling/test_sampler_engine.py covers the rungs)
    "sampling.row_buckets=1",
    # the random tiny model scores 0 on every problem: run its updates anyway, as the tests of
    # update programs, resume and checkpoints need (tests/train/test_train.py tests the skip)
    "train.skip_no_signal=false",
]


# --peer-timeout of the tests' multi-process runs: far above any stall a loaded CI host gives a
# live process (2 s once ended a healthy rerun at load 5, its coordinator's answers late), so
# only a real death or stop trips it; the tests assert the line, not the time it took.
PEER_TIMEOUT_S = 15


def stopped_with_one_line(err: str, run_dir, said: tuple[str, ...]) -> bool:
    """Whether a survivor's stderr ``err`` is exactly one line, ``train: WHAT; the last
    checkpoint is step 2 in RUN_DIR/checkpoints; ...`` for a WHAT of ``said``."""
    lines = [line for line in err.splitlines() if line.strip()]
    return any(
        lines
        == [
            f"train: {what}; the last checkpoint is step 2 in {run_dir}/checkpoints; run the "
            "same command on every process to resume"
        ]
        for what in said
    )


def dead_peer_said(process: int, of: int) -> tuple[str, ...]:
    """What a survivor's one line may say of process ``process`` (of ``of``) that died: the peer
    watch's words after PEER_TIMEOUT_S, or, on a host so loaded that the watch's threads ran a
    minute late, the words of its backstop, jax.distributed's heartbeat timeout (the supervisor
    names the process). Either way one line naming the process, the checkpoint, how to resume."""
    return (
        f"process {process} of {of} stopped responding (no heartbeat for {PEER_TIMEOUT_S} s, "
        "--peer-timeout)",
        f"process {process} of {of} stopped sending heartbeats (jax.distributed's heartbeat "
        "timeout, the backstop of --peer-timeout)",
    )


# A dataset task on a file of a few rows, its prompts as written: no held-out split (the
# evaluation reads the first training rows) and no chat template.
RAW_ROWS = ["data.eval_split=0", "data.chat_template=false"]


class CyclingController(GroupController):
    """Visits the candidates in a fixed cycle (drives the compile-count tests)."""

    def __init__(self, candidates):
        super().__init__(tuple(candidates), tau=3.0, scope="group")
        self.order = [g for _ in range(3) for g in candidates]

    def _decide(self):
        return self.order[self.step % len(self.order)]

    def _learn(self, group_size, s_t, lengths_pg):
        return {}


def constant_reward(prompts, completions, answers):
    """A reward (``data.reward=helpers:constant_reward``) that scores every completion 1: every
    group's rewards are equal, so no step has a learning signal."""
    return [1.0] * len(completions)


def half_signal_reward(prompts, completions, answers):
    """A reward (``data.reward=helpers:half_signal_reward``) with signal in about half the
    groups: a prompt whose characters' codes sum to an even number scores each of its
    completions 1 (rewards all equal, so advantages 0), another the parity of each completion's
    length."""
    return [
        1.0 if sum(map(ord, p)) % 2 == 0 else float(len(c) % 2)
        for p, c in zip(prompts, completions, strict=True)
    ]


def write_word_tokenizer(path):
    """A tiny word-level tokenizer.json + tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
        "what",
        "is",
        "plus",
        "the",
        "answer",
        "user:",
        "assistant:",
        *[str(i) for i in range(20)],
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}user: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "chat_template": template,
            }
        )
    )


def enospc_on_step(monkeypatch, step):
    """Orbax's write of ``meta`` for ``step`` writes half a file, then finds the disk full (it
    runs in Orbax's commit threads, like the array writes)."""
    import errno

    from orbax.checkpoint._src.handlers.json_checkpoint_handler import JsonCheckpointHandler

    original = JsonCheckpointHandler._save_fn

    async def save_fn(self, x, directory):
        if os.path.basename(str(directory.parent)).startswith(f"{step}.orbax-checkpoint-tmp"):
            (directory / "metadata").write_text('{"step": ')
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "metadata"))
        return await original(self, x, directory)

    monkeypatch.setattr(JsonCheckpointHandler, "_save_fn", save_fn)


def sets(overrides):
    """``--set`` arguments of a list of ``section.key=value`` overrides."""
    return [a for o in overrides for a in ("--set", o)]


def tree_digest(path):
    """Hash of every file under ``path`` (names and bytes)."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def capture_figures(monkeypatch) -> dict:
    """{file name: matplotlib Figure} of every PNG the code under test saves (the files are still
    written): plots are checked as data (lines, bands, legends), not as images."""
    from matplotlib.figure import Figure

    saved, savefig = {}, Figure.savefig

    def record(fig, path, *args, **kwargs):
        saved[Path(path).name] = fig
        return savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


def band_limits(ax) -> tuple[float, float]:
    """(lowest, highest) finite y of every band (``fill_between``) drawn on ``ax``."""
    import numpy as np

    y = np.concatenate([p.vertices[:, 1] for c in ax.collections for p in c.get_paths()])
    y = y[np.isfinite(y)]
    return float(y.min()), float(y.max())


def delta_lines(ax) -> list[float]:
    """The y of every horizontal line labelled "delta" on ``ax``."""
    lines = [line for line in ax.get_lines() if line.get_label() == "delta"]
    return [float(line.get_ydata()[0]) for line in lines if len(set(line.get_ydata())) == 1]


def legend_labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]
