"""Bad user files and hanging rewards: one line naming the file (or the function and the row),
exit code 2, nothing already written lost (docs/reliability.md)."""

import json
import shutil
import textwrap
import time

import pytest
from helpers import RAW_ROWS, TINY, sets, write_word_tokenizer

from sagc_jax.cli import main
from sagc_jax.tasks import RewardError, TimeLimitedReward, resolve_reward, score_batch
from sagc_jax.train.hooks import RewardStallNotice, StepLog
from sagc_jax.train.metrics import StepCounts

# --------------------------------------------------------------------------- damaged files


@pytest.fixture(scope="module")
def good_files(tmp_path_factory):
    """A tokenizer, a tiny HF checkpoint that uses it, and the dataset as JSONL and Parquet."""
    from flax import nnx

    from sagc_jax.models import Decoder, get_preset, save_hf_checkpoint

    root = tmp_path_factory.mktemp("good")
    write_word_tokenizer(root / "tok")
    arch = get_preset("tiny").replace(vocab_size=64)
    save_hf_checkpoint(Decoder(arch, rngs=nnx.Rngs(0)), arch, str(root / "hf"))
    rows = [
        {"prompt": f"what is {a} plus {b}", "answer": str(a + b)} for a in range(3) for b in (1, 2)
    ]
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), root / "d.parquet")
    return root


def cut(keep=0.5):
    """Keep the first ``keep`` of the file (a copy or a download that stopped)."""

    def damage(path):
        path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])

    return damage


def put(content):
    def damage(path):
        path.write_bytes(content if isinstance(content, bytes) else content.encode())

    return damage


def patch(**changes):
    def damage(path):
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return damage


def jinja(template):
    """A chat_template.jinja beside a tokenizer_config.json without a template."""

    def damage(path):
        patch(chat_template=None)(path.parent / "tokenizer_config.json")
        put(template)(path)

    return damage


TOK, TOK_CFG, JINJA = "tok/tokenizer.json", "tok/tokenizer_config.json", "tok/chat_template.jinja"
HF_CFG, WEIGHTS, INDEX = "hf/config.json", "hf/model.safetensors", "hf/model.safetensors.index.json"
HF = ["model.hf_checkpoint=CASE/hf"]
CHAT = ["data.chat_template=true"]
YAML = ["--config"]
# (case, the file it damages, how, extra --set, what the line says besides the file's path)
FAULTS = [
    ("tokenizer_truncated", TOK, cut(), [], "truncated"),
    ("tokenizer_not_utf8", TOK, put(b"\xff\xfe"), [], "UTF-8"),
    ("tokenizer_not_a_tokenizer", TOK, put("{}"), [], "Model missing"),
    ("tok_config_truncated", TOK_CFG, cut(), [], "truncated"),
    ("tok_config_a_list", TOK_CFG, put("[1]"), [], "JSON object"),
    ("tok_config_eos_a_number", TOK_CFG, patch(eos_token=2), [], '"eos_token": 2'),
    ("template_a_number", TOK_CFG, patch(chat_template=5), CHAT, '"chat_template" is a int'),
    ("template_syntax", TOK_CFG, patch(chat_template="{% for m in messages %}"), CHAT, "jinja2"),
    ("template_raises", TOK_CFG, patch(chat_template="{{ raise_exception('no sys') }}"), CHAT,
     "no sys"),
    ("template_missing", TOK_CFG, patch(chat_template=None), CHAT, "data.chat_template=false"),
    ("jinja_file_syntax", JINJA, jinja("{% if %}"), CHAT, "not a valid jinja2 template"),
    ("jinja_file_not_utf8", JINJA, jinja(b"\xff{{ x }}"), CHAT, "UTF-8"),
    ("hf_config_truncated", HF_CFG, cut(), HF, "truncated"),
    ("hf_config_a_list", HF_CFG, put("[]"), HF, "JSON object"),
    ("hf_config_no_size", HF_CFG, patch(hidden_size=None), HF, '"hidden_size"'),
    ("hf_config_size_a_string", HF_CFG, patch(hidden_size="big"), HF, "positive integer"),
    ("hf_config_other_family", HF_CFG, patch(model_type="gpt2"), HF, "not supported"),
    ("weights_truncated", WEIGHTS, cut(0.9), HF, "not a readable safetensors file"),
    ("weights_empty", WEIGHTS, put(b""), HF, "not a readable safetensors file"),
    ("index_truncated", INDEX, put('{"weight_map": {'), HF, "truncated"),
    ("index_names_a_missing_file", INDEX, put('{"weight_map": {"lm_head.weight": "gone"}}'), HF,
     "names gone"),
    ("jsonl_truncated", "d.jsonl", cut(0.6), [], "not valid JSON"),
    ("jsonl_not_utf8", "d.jsonl", put(b'{"prompt": "\xff", "answer": "1"}\n'), [], "UTF-8"),
    ("parquet_truncated", "d.parquet", cut(), ["data.path=CASE/d.parquet"], "Parquet"),
    ("yaml_truncated", "c.yaml", put("train:\n  steps: [1,\n"), YAML, "not valid YAML"),
    ("yaml_not_utf8", "c.yaml", put(b"train:\n  steps: \xff\n"), YAML, "UTF-8"),
    ("yaml_section_a_list", "c.yaml", put("train: [1, 2]\n"), YAML, "must be a mapping"),
]  # fmt: skip


@pytest.mark.parametrize(
    "file, damage, extra, needle", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS]
)
def test_a_damaged_file_is_one_line_naming_it(
    good_files, tmp_path, capsys, file, damage, extra, needle
):
    case = tmp_path / "case"
    shutil.copytree(good_files, case)
    damage(case / file)
    config = ["--config", str(case / file)] if extra == YAML else []
    extra = [] if config else [e.replace("CASE", str(case)) for e in extra]
    overrides = [
        *TINY,
        "data.task=dataset",
        *RAW_ROWS,
        f"data.path={case / 'd.jsonl'}",
        f"model.tokenizer={case / 'tok'}",
        *extra,
        f"logging.run_dir={case / 'run'}",
    ]
    code = main(["train", *config, *sets(overrides)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert str(case / file) in err and needle in err, err
    assert not (case / "run").exists()  # a refused start leaves nothing behind


@pytest.mark.parametrize(
    "command", [["plan", "--set", "model.hf_checkpoint=HF"], ["simulate", "--as-model", "HF"]]
)
def test_plan_and_simulate_name_a_damaged_hf_config(good_files, tmp_path, capsys, command):
    case = tmp_path / "case"
    shutil.copytree(good_files, case)
    put("[]")(case / HF_CFG)
    (case / "c.yaml").write_text("sim:\n  steps: 2\n")
    args = [a.replace("HF", str(case / "hf")) for a in command]
    run = ["--set", f"logging.run_dir={case / 'run'}"]
    code = main([args[0], "--config", str(case / "c.yaml"), *args[1:], *run])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{case / HF_CFG}: " in err, err
    assert "must be a JSON object" in err and "Traceback" not in err, err


# --------------------------------------------------------------------------- hanging rewards

USER_REWARDS = textwrap.dedent(
    """
    import os, re, time

    def hang_on_bad(prompts, completions, answers):
        if any(c == "bad" for c in completions):
            time.sleep(10**6)  # a bug: one completion makes it loop forever
        return [float(len(c)) for c in completions]

    def backtracks(prompts, completions, answers):
        # catastrophic backtracking: C code that holds the GIL, no thread could stop it
        return [float(bool(re.match(r"(a+)+$", c))) for c in completions]

    def raises(prompts, completions, answers):
        if "bad" in completions:
            raise KeyError("no judge for 'bad'")
        return [1.0] * len(completions)

    def hang_from_step_2(prompts, completions, answers):
        log = os.environ["SAGC_TEST_REWARD_LOG"]
        if len(prompts) > 1 and prompts[0] == prompts[1]:  # a training batch: G >= 2 per prompt
            with open(log, "a") as f:
                f.write("x")
        if os.path.exists(log) and os.path.getsize(log) >= 2:
            time.sleep(10**6)
        return [float(len(c) % 2) for c in completions]

    def stalls_on_batches(prompts, completions, answers):
        if len(completions) > 1:
            time.sleep(10**6)  # a whole batch never finishes; one row at a time is quick
        return [float(len(c) % 2) for c in completions]
    """
)
# a hanging row waits this long: far above what scoring a row takes, even on a loaded host
LIMIT = 2.0


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "sagc_test_slow_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(name, limit=LIMIT):
        made.append(resolve_reward(f"sagc_test_slow_rewards:{name}", reward_timeout_s=limit))
        return made[-1]

    yield make
    for reward in made:
        getattr(reward, "close", lambda: None)()


C = ["a", "bb", "bad", "dddd"]


def test_a_hanging_reward_is_stopped_naming_the_function_and_the_row(user_rewards):
    reward = user_rewards("hang_on_bad")
    assert isinstance(reward, TimeLimitedReward)
    assert score_batch(reward, C[:2], C[:2], C[:2]).rewards.tolist() == [1, 2]  # starts the worker
    t0 = time.monotonic()
    with pytest.raises(RewardError) as err:
        score_batch(reward, C, C, C, on_error="raise")
    elapsed = time.monotonic() - t0
    message = str(err.value)
    assert "sagc_test_slow_rewards:hang_on_bad" in message and "index 2 of 4" in message
    assert f"data.reward_timeout_s = {LIMIT:g} s" in message and "\n" not in message
    # the batch, then the rows alone (a second worker starts then): twice the limit at least
    # (the upper bound only tells a wait from a hang)
    assert 2 * LIMIT <= elapsed < 2 * LIMIT + 120, elapsed


def test_a_hanging_row_scores_zero_and_is_counted_with_the_zero_policy(user_rewards):
    result = score_batch(user_rewards("hang_on_bad"), C, C, C, on_error="zero")
    assert result.rewards.tolist() == [1, 2, 0, 4]  # the other rows keep their scores
    assert result.timed_out == (2,) and result.failed == ()
    backtracking = ["aaaa", "a" * 40 + "b", "aa", "b"]
    result = score_batch(user_rewards("backtracks"), C, backtracking, C, on_error="zero")
    assert result.rewards.tolist() == [1, 0, 1, 0] and result.timed_out == (1,)


def test_a_reward_that_raises_in_its_worker_is_named_as_in_process(user_rewards):
    with pytest.raises(RewardError, match=r"raises failed at index 2 of 4 \(raised KeyError"):
        score_batch(user_rewards("raises"), C, C, C)
    result = score_batch(user_rewards("raises"), C, C, C, on_error="zero")
    assert result.rewards.tolist() == [1, 1, 0, 1] and result.failed == (2,)
    assert result.timed_out == ()


def test_a_batch_that_runs_past_the_limit_then_scores_row_by_row_is_counted(user_rewards):
    reward = user_rewards("stalls_on_batches", limit=3)  # rows alone have time to spare
    result = score_batch(reward, C, C, C, on_error="raise")  # nothing fails, nothing raises
    assert result.rewards.tolist() == [1, 0, 1, 0]
    assert result.batch_timed_out and result.timed_out == () and result.failed == ()
    assert not score_batch(reward, C[:1], C[:1], C[:1]).batch_timed_out  # a row is no batch
    assert not score_batch(user_rewards("hang_on_bad"), C[:2], C[:2], C[:2]).batch_timed_out


def test_the_reward_stall_notice_speaks_once_per_run():
    lines = []
    notice = RewardStallNotice("mod:fn", 3.0, lines.append)
    for step, count in enumerate([0, 2, 1, 0, 1], 1):
        counts = StepCounts(0, 0, count, 0, 0, 0, 0)
        notice(step, StepLog(None, counts, {}))  # the notice reads the typed counts only
    assert lines == [
        "step 2: reward mod:fn ran past data.reward_timeout_s = 3 s on a whole batch, then "
        "scored its rows one by one; each such batch costs up to twice the limit; counted in "
        "reward_batch_timeouts (said once)"
    ]


@pytest.mark.slow
def test_a_run_counts_batches_past_the_limit_and_says_so_once(user_rewards, tmp_path, capsys):
    run = tmp_path / "run"
    overrides = [
        *TINY,
        "logging.tensorboard=false",
        "data.reward=sagc_test_slow_rewards:stalls_on_batches",
        "data.reward_timeout_s=3",
        "train.steps=2",
        "controller.kind=fixed",
        "controller.group_size=2",
        "train.eval_size=2",
        f"logging.run_dir={run}",
    ]
    assert main(["train", *sets(overrides)]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "on a whole batch" in line]
    assert said == [
        "train: step 1: reward sagc_test_slow_rewards:stalls_on_batches ran past "
        "data.reward_timeout_s = 3 s on a whole batch, then scored its rows one by one; each "
        "such batch costs up to twice the limit; counted in reward_batch_timeouts (said once)"
    ]
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "group_size" in r]
    assert [r["reward_batch_timeouts"] for r in steps] == [1, 1]  # one round per step
    assert [r["reward_timeouts"] for r in steps] == [0, 0]  # every row scored in time


def test_no_limit_calls_the_function_itself(user_rewards):
    reward = user_rewards("raises", limit=0)
    assert not isinstance(reward, TimeLimitedReward) and reward.__name__ == "raises"
    assert resolve_reward("synthetic", reward_timeout_s=5) is resolve_reward("synthetic")


@pytest.mark.slow
def test_a_reward_that_hangs_mid_run_stops_it_and_keeps_the_checkpoint(
    user_rewards, tmp_path, capsys, monkeypatch
):
    from sagc_jax.train.safety.checkpoint import CheckpointStore

    monkeypatch.setenv("SAGC_TEST_REWARD_LOG", str(tmp_path / "calls"))
    run = tmp_path / "run"
    overrides = [
        *TINY,
        "logging.tensorboard=false",
        "data.reward=sagc_test_slow_rewards:hang_from_step_2",
        f"data.reward_timeout_s={LIMIT}",
        "train.checkpoint_every=1",
        "train.steps=3",
        "controller.kind=fixed",  # one G, fewer programs to compile
        "controller.group_size=2",
        "train.eval_size=2",
        f"logging.run_dir={run}",
    ]
    assert main(["train", *sets(overrides)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: reward sagc_test_slow_rewards:hang_from_step_2 ran past")
    assert "at index 0 of " in err and err.count("\n") == 1, err
    store = CheckpointStore(run / "checkpoints")
    assert store.latest_step() == 1  # step 1, saved before the hang, is kept
    store.close()
    assert (run / "checkpoints" / "1" / "integrity.json").is_file()  # and sealed
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == [0, 1]
