"""Never lose a run: atomic verified checkpoints, loading refusals, exact in-process resume, quarantine of
a diverging member, and the CLI's one-line errors (bad-input corpus, CLI part)."""

import json
import math

import pytest
import torch
from conftest import StopAt, make_grpo

from evollm.utils.atomic import CheckpointError, verify
from evollm.run.population_checkpoint import load_population, save_population
from evollm.recipes.cli import main
from evollm.hpo import HyperparameterConfig, Mutations, RLParameter, TournamentSelection
from evollm.run.population import Population
from evollm.run import RunInterrupted, list_checkpoints
from evollm.training import Callback
from evollm.training.loop import finetune_llm_reasoning


def _env(tok, seed=0, digits=(1, 1)):
    from evollm.envs.reasoning import ReasoningGym
    from evollm.tasks import ARITHMETIC_TEMPLATE, arithmetic_dataset, exact_match_reward

    train, test = arithmetic_dataset(n_train=64, n_test=8, digits=digits, seed=0)
    return ReasoningGym(train, test, tok, exact_match_reward, ARITHMETIC_TEMPLATE, data_batch_size_per_gpu=4,
                        seed=seed)


def _run(ckpt, resume=False, callbacks=(), lrs=(3e-3, 3e-3, 3e-3), max_steps=6, cache_dir=None, evo_steps=2):
    from evollm.recipes.warm_start import load_tiny_model

    torch.manual_seed(0)
    model, tok = load_tiny_model(warm_start=cache_dir is not None, cache_dir=cache_dir, seed=0)
    hp = HyperparameterConfig(lr=RLParameter(min=1e-4, max=1e-2, log=True))
    pop = make_grpo(model, tok, n=len(lrs), lr=lrs[0], hp_config=hp)
    for agent, lr in zip(pop, lrs):
        agent.set_hyperparameter("lr", lr)
    return finetune_llm_reasoning(
        pop, _env(tok, digits=(1, 2) if cache_dir else (1, 1)), max_steps=max_steps, evaluation_interval=2,
        evo_steps=evo_steps, verbose=False, seed=0,
        tournament=TournamentSelection(2, True, len(lrs), rand_seed=0), callbacks=callbacks,
        mutation=Mutations(no_mutation=0.0, rl_hp=1.0, rand_seed=0), checkpoint_dir=ckpt, checkpoint_every=1,
        keep_checkpoints=2, resume=resume)


def _adapters(agents):
    return {(a.index, k): v for a in agents for k, v in a.shared.state_dict(a.adapter_name()).items()}


def test_resume_in_process_is_exact_and_keeps_last_k(tmp_path):
    agents, record = _run(tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "b", callbacks=[StopAt(3)])  # the checkpointer runs first: step 3 is saved
    assert [s for s, _ in list_checkpoints(tmp_path / "b")] == [2, 3]
    again, record2 = _run(tmp_path / "b", resume=True)
    assert [a.index for a in agents] == [a.index for a in again]
    one, two = _adapters(agents), _adapters(again)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert record.report().equals(record2.report()) and record.lineage().equals(record2.lineage())
    assert [s for s, _ in list_checkpoints(tmp_path / "a")] == [5, 6]
    for agent, other in zip(agents, again):
        assert agent.fitness == other.fitness and agent.config == other.config


def test_checkpoint_is_refused_when_a_file_is_missing_or_changed(tmp_path, tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    path = save_population(pop, Population(pop), tmp_path / "pop")
    verify(path, "population")
    target = path / f"member_{pop[1].index}" / "optimizer.safetensors"
    data = target.read_bytes()
    target.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=f"member_{pop[1].index}/optimizer.safetensors does not match its sha256"):
        load_population(path, type(pop[0]), model, pad_token_id=tok.pad_token_id)
    target.unlink()
    with pytest.raises(CheckpointError, match="optimizer.safetensors is listed in manifest.json but missing"):
        verify(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        verify(path)


def _rewrite_manifest(folder):
    from evollm.utils.atomic import write_manifest

    write_manifest(folder, json.loads((folder / "manifest.json").read_text())["kind"])


def test_loading_refuses_bad_tensors_hyperparameters_and_another_base(tmp_path, tiny):
    from safetensors.torch import load_file, save_file

    from evollm.recipes.warm_start import load_tiny_model

    model, tok = tiny
    agent = make_grpo(model, tok)[0]
    agent.save_checkpoint(tmp_path / "a")
    weights = tmp_path / "a" / "adapter" / "adapter_model.safetensors"
    full = load_file(str(weights))
    other = make_grpo(model, tok)[0]

    half = dict(list(full.items())[: len(full) // 2])
    save_file(half, str(weights))
    _rewrite_manifest(tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"adapter tensors are missing"):
        other.load_checkpoint(tmp_path / "a")

    save_file({**full, "base_model.model.extra.lora_A.weight": torch.zeros(8, 4)}, str(weights))
    _rewrite_manifest(tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"adapter tensors this model does not have"):
        other.load_checkpoint(tmp_path / "a")

    key = next(k for k in full if "lora_A" in k)
    save_file({**full, key: torch.zeros(4, full[key].shape[1])}, str(weights))
    _rewrite_manifest(tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"does not fit the recorded rank r=8"):
        other.load_checkpoint(tmp_path / "a")

    save_file(full, str(weights))
    info = json.loads((tmp_path / "a" / "agent.json").read_text())
    info["config"]["lr"] = -1.0
    (tmp_path / "a" / "agent.json").write_text(json.dumps(info))
    _rewrite_manifest(tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"invalid hyperparameters: lr must be a finite number > 0"):
        other.load_checkpoint(tmp_path / "a")

    pop = make_grpo(model, tok, n=2)
    save_population(pop, Population(pop), tmp_path / "pop")
    different, _ = load_tiny_model(warm_start=False, seed=1)
    with pytest.raises(CheckpointError, match="trained on a different base model: the base weights differ"):
        load_population(tmp_path / "pop", type(pop[0]), different, pad_token_id=tok.pad_token_id)


def test_load_population_onto_the_model_that_trained_it(tmp_path, tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=2)
    with torch.no_grad():
        pop[1].shared.parameters(pop[1].adapter_name())[1].add_(0.5)
    before = _adapters(pop)
    save_population(pop, Population(pop), tmp_path / "pop")
    kwargs = dict(pad_token_id=tok.pad_token_id, pad_token=tok.pad_token, eos_token_id=tok.eos_token_id)
    with pytest.raises(CheckpointError, match=r"is still alive on this model .* release the trained members first"):
        load_population(tmp_path / "pop", type(pop[0]), model, **kwargs)
    for agent in pop:
        agent.release()
    agents, _ = load_population(tmp_path / "pop", type(pop[0]), model, **kwargs)
    after = _adapters(agents)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert agents[0].shared.next_index() == 2  # ids are still never reused


def test_member_ids_from_a_checkpoint_must_be_integers(tmp_path, tiny):
    model, tok = tiny
    pop = make_grpo(model, tok, n=1)
    path = save_population(pop, Population(pop), tmp_path / "pop")
    state = json.loads((path / "population.json").read_text())
    state["members"] = ["../../etc"]
    (path / "population.json").write_text(json.dumps(state))
    _rewrite_manifest(path)
    with pytest.raises(CheckpointError, match=r"member id '../../etc' is not a non-negative integer"):
        load_population(path, type(pop[0]), model, pad_token_id=tok.pad_token_id)


def test_a_diverging_member_is_quarantined_and_the_population_goes_on(tmp_path, cache_dir):
    agents, record = _run(tmp_path / "q", lrs=(3e-3, 1e6, 3e-3), max_steps=8, cache_dir=cache_dir, evo_steps=4)
    report = record.report()
    sick = report[report["quarantined"]]
    assert len(sick) >= 1 and set(sick["member"]) == {1}
    assert (sick["fitness"] == -math.inf).all()
    assert all(not getattr(a, "quarantined", False) for a in agents), "clones never inherit the flag"
    assert 1 not in [a.index for a in agents]
    births = record.lineage()
    assert 1 not in set(births["parent"].dropna().astype(int))  # no clone of the quarantined member
    for a in agents:
        assert all(torch.isfinite(p).all() for p in a.shared.parameters(a.adapter_name()))


def test_sigint_saves_a_checkpoint_and_says_how_to_resume(tmp_path, cache_dir, capsys):
    import os
    import signal

    class Interrupt(Callback):
        def on_step_end(self, state, metrics):
            if state.step == 2:
                os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN under `nohup ... &`
    with pytest.raises(RunInterrupted) as info:
        _run(tmp_path / "s", callbacks=[Interrupt()])
    assert info.value.step == 2 and (tmp_path / "s" / "step_2" / "manifest.json").exists()
    assert signal.getsignal(signal.SIGINT) is before  # the run gives the handler it found back


# ----------------------------------------------------------------------------- bad-input corpus (CLI)
def _cli_case(tmp_path, name):
    good = tmp_path / "good.yaml"
    good.write_text(open("configs/demo.yaml").read())
    cases = {
        "missing file": (["train", str(tmp_path / "nope.yaml")], "does not exist"),
        "directory as config": (["train", str(tmp_path)], "is a directory, not a YAML file"),
        "bad yaml": (["train", str(_write(tmp_path, "x.yaml", "algorithm: {name: GRPO\n"))], "invalid YAML at line"),
        "yaml list": (["train", str(_write(tmp_path, "y.yaml", "- 1\n- 2\n"))], "the config must be a mapping"),
        "bad --set": (["train", str(good), "--set", "train.max_steps"], "must look like section.key=value"),
        "bad --set value": (["train", str(good), "--set", "train.max_steps=[1"], "train.max_steps"),
        "unknown --set key": (["train", str(good), "--set", "train.max_stepz=3"], "did you mean 'max_steps'"),
        "output_dir is a file": (["train", str(good), "--set", f"output_dir={good}"], "is a file, not a directory"),
        "output_dir not empty": (["train", str(good), "--set", f"output_dir={_nonempty(tmp_path)}"],
                                 "already holds files; pass --overwrite"),
        "overwrite foreign dir": (["train", str(good), "--overwrite", "--set", f"output_dir={_nonempty(tmp_path)}"],
                                  "is not an evollm run directory"),
        "resume missing dir": (["resume", str(tmp_path / "none")], "does not exist"),
        "resume not a run": (["resume", str(_nonempty(tmp_path))], "is not an evollm run directory"),
        "resume other --set": (["resume", str(_run_dir(tmp_path)), "--set", "seed=3"],
                               "seed cannot change when resuming (it would make another run); resume can change train.max_steps"),
        "resume no checkpoint": (["resume", str(_run_dir(tmp_path)), "--set", "train.max_steps=3"],
                                 "no valid checkpoint in"),
    }
    return cases[name]


def _write(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return tmp_path / name


def _nonempty(tmp_path):
    d = tmp_path / "notes"
    d.mkdir(exist_ok=True)
    (d / "mine.txt").write_text("keep me")
    return d


def _run_dir(tmp_path):
    d = tmp_path / "run"
    (d / "checkpoints" / "step_4").mkdir(parents=True, exist_ok=True)  # no manifest: an interrupted save
    (d / "run_config.json").write_text(json.dumps({"algorithm": {"name": "GRPO", "population_size": 2},
                                                   "model": {"warm_start": False}, "threads": 1,
                                                   "task": {"n_train": 16, "n_test": 4}}))
    return d


CLI_CASES = ["missing file", "directory as config", "bad yaml", "yaml list", "bad --set", "bad --set value",
             "unknown --set key", "output_dir is a file", "output_dir not empty", "overwrite foreign dir",
             "resume missing dir", "resume not a run", "resume other --set", "resume no checkpoint"]


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_user_errors_are_one_line(tmp_path, capsys, name):
    argv, expected = _cli_case(tmp_path, name)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1 and "Traceback" not in err
    if "notes" in " ".join(argv):
        assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        main(["--debug", "train", str(tmp_path / "nope.yaml")])
