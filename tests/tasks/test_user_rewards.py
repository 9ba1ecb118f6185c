"""A user's reward by module path or file path, TRL-style batched rewards and TRL dataset forms."""

import json
import sys

import pytest

from evollm.envs.reasoning import ReasoningGym, prompt_messages
from evollm.tasks.reward_spec import locate_reward
from evollm.tasks.user import check_task, resolve_reward, task_parts


@pytest.fixture
def reward_tree(tmp_path, monkeypatch):
    """configs/mytask/myreward.py (a namespace folder) and a package with a relative import."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # importing a reward file adds its folder
    (tmp_path / "cfg" / "mytask").mkdir(parents=True)
    (tmp_path / "cfg" / "mytask" / "myreward.py").write_text(
        "def larger(completion, answer, question):\n    return float(len(completion))\n")
    pkg = tmp_path / "cfg" / "rwpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text("BONUS = 0.25\n")
    (pkg / "scores.py").write_text("from .helpers import BONUS\n\ndef score(completion, answer, question):\n"
                                   "    return BONUS\n")
    yield tmp_path
    for name in ("mytask", "mytask.myreward", "myreward", "rwpkg", "rwpkg.scores", "rwpkg.helpers"):
        sys.modules.pop(name, None)


def test_module_and_file_specs_resolve_against_the_given_folders(reward_tree, monkeypatch):
    cfg = reward_tree / "cfg"
    monkeypatch.chdir(reward_tree)  # the working directory is not the config's folder
    for spec in ("mytask.myreward:larger", "mytask/myreward.py:larger", "mytask.myreward.larger"):
        located = locate_reward(spec, [cfg, reward_tree])
        assert located == f"{cfg / 'mytask' / 'myreward.py'}:larger", spec
        assert resolve_reward(located)("abc", 1, "q") == 3.0
    # a package keeps its relative imports
    located = locate_reward("rwpkg.scores:score", [cfg])
    assert located.endswith("rwpkg/scores.py:score") and resolve_reward(located)("", 0, "") == 0.25
    # the remembered (absolute) spec works from anywhere
    monkeypatch.chdir("/")
    assert resolve_reward(f"{cfg}/mytask/myreward.py:larger")("ab", 0, "") == 2.0
    # built-in names and installed modules are left as they are
    assert locate_reward("last_number", [cfg]) == "last_number"
    assert locate_reward("evollm.tasks.rewards:exact_match_reward", [cfg]) == "evollm.tasks.rewards:exact_match_reward"


def test_a_reward_that_cannot_be_found_says_where_it_looked(reward_tree, monkeypatch):
    monkeypatch.chdir(reward_tree)
    with pytest.raises(ValueError) as err:
        locate_reward("mytask.myreward:larger", [reward_tree])  # the file is under cfg/, not here
    msg = str(err.value)
    assert "cannot import module 'mytask.myreward'" in msg and str(reward_tree) in msg
    assert "path/to/rewards.py:larger" in msg and "PYTHONPATH" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="file 'nope/r.py' not found"):
        locate_reward("nope/r.py:f", [reward_tree])
    (reward_tree / "broken.py").write_text("import numpyy_missing\n\ndef f(completion, answer, question):\n    return 0\n")
    with pytest.raises(ValueError, match=r"importing .*broken.py.* failed: ModuleNotFoundError.*line 1 of"):
        resolve_reward(str(reward_tree / "broken.py") + ":f")
    with pytest.raises(ValueError, match=r"has no function 'big'; its functions: \['larger'\]"):
        resolve_reward(str(reward_tree / "cfg/mytask/myreward.py") + ":big")


def _rows(n):
    return [{"prompt": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(n)]


def test_trl_batched_reward_on_a_trl_text_prompt_dataset(tiny):
    _, tok = tiny
    calls = []

    def accuracy(completions, solution, **kwargs):  # TRL's shape
        calls.append((list(completions), list(solution), kwargs["prompts"]))
        return [float(c.strip() == s) for c, s in zip(completions, solution)]

    env = ReasoningGym(_rows(8), _rows(2), tok, accuracy, None, data_batch_size_per_gpu=2)
    assert env.batched_reward and env.train[0]["text"] == env.train[0]["prompt"]  # TRL text: used as it is
    prompts = env.reset()
    rewards = env.score([[str(r["columns"]["solution"]), "nope"] for r in prompts])
    assert rewards.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert len(calls) == 1 and len(calls[0][0]) == 4  # ONE call for the whole batch
    assert calls[0][2][0] == prompts[0]["prompt"] == calls[0][2][1]


def test_conversational_prompts_get_messages_and_message_completions(tiny):
    _, tok = tiny
    seen = {}

    def reward(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [1.0 if c[0]["content"] == a else 0.0 for c, a in zip(completions, answer)]

    conv = [{"messages": [{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]}
            for i in range(6)]
    env = ReasoningGym(conv, conv[:2], tok, reward, [{"role": "system", "content": "Be brief."}],
                       data_batch_size_per_gpu=2)
    row = env.train[0]
    assert row["answer"] == row["columns"]["answer"] and row["conversational"]
    assert "Be brief." in row["text"] and row["answer"] not in row["text"].rsplit("+1=", 1)[1]
    assert env.score([[r["answer"]] for r in env.reset()]).tolist() == [[1.0], [1.0]]
    assert seen["completions"][0] == [{"role": "assistant", "content": env.reset()[0]["answer"]}]
    assert seen["prompts"][0] == [{"role": "user", "content": env.reset()[0]["question"]}]


def test_prompt_messages_forms():
    msgs, f = prompt_messages({"question": "2+2", "answer": 4}, None)
    assert msgs == [{"role": "user", "content": "2+2"}] and f["prompt"] == "2+2"
    msgs, f = prompt_messages({"prompt": [{"role": "user", "content": "hi"}]},
                              [{"role": "user", "content": "ignored {question}"},
                               {"role": "assistant", "content": "Sure:"}])
    assert msgs == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]
    with pytest.raises(ValueError, match=r"the prompt template uses \{level\}, which is not a dataset column"):
        prompt_messages({"question": "q", "answer": 1}, [{"role": "user", "content": "{level}: {question}"}])


def test_check_task_catches_columns_placeholders_and_rewards_before_any_model(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"q": f"{i}+1", "a": i + 1}) for i in range(10)))
    kw = dict(dataset=tmp_path / "d.jsonl", columns={"question": "q", "answer": "a"}, test_size=2)
    check_task(*task_parts("dataset", **kw))
    with pytest.raises(ValueError, match=r"task: train row 0: the prompt template uses \{level\}"):
        check_task(*task_parts("dataset", **kw, user_template="{level} {question}"))
    with pytest.raises(ValueError, match="task.columns.answer='sol' is not a column"):
        task_parts("dataset", dataset=tmp_path / "d.jsonl", columns={"question": "q", "answer": "sol"})
    with pytest.raises(ValueError, match="returned None .*not a finite number.*must return a float"):
        check_task(*task_parts("dataset", **kw, reward=lambda c, a, q: None))
    with pytest.raises(ValueError, match="returned 1 rewards for 2 completions"):
        check_task(*task_parts("dataset", **kw, reward=lambda completions, **k: [1.0]), rows=2)
    with pytest.raises(ValueError, match=r"has no 'answer' column .*task.columns.answer"):
        check_task(*task_parts("dataset", dataset=tmp_path / "d.jsonl", columns={"question": "q"}, test_size=2))
    with pytest.raises(ValueError, match=r"must take \(completion, answer, question\).*or \(completions, \*\*kwargs\)"):
        resolve_reward(lambda c: 0.0)
