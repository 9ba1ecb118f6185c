"""Independent PPO (IPPO) for teams of cooperating LLM agents on ONE shared base model.

A team of ``num_agents`` agents shares a joint reward; each agent is an :class:`IPPOAgent` with its
own actor LoRA adapter, its own value head and either its own critic LoRA adapter
(``use_separate_critic=True``) or a value head on its actor (``False``), all on the same frozen
base, plus its own optimizer. The other agents are part of each agent's environment. An
:class:`IPPOTeam` is ONE population member: evolution selects, clones and mutates whole teams.

Settings use the names of CoMLRL's ``IPPOConfig`` where they exist (``actor_learning_rate``,
``critic_learning_rate``, ``ppo_epochs``, ``mini_batch_size``, ``rollout_buffer_size``,
``value_clip_range``, ``value_loss_coef``, ``entropy_coef``, ``advantage_normalization``,
``max_new_tokens``, ``use_separate_critic``, ``num_agents``, ``num_turns``, ...). Unlike CoMLRL's
on-policy update, the update has a real importance ratio with clipping (``clip_coef``), several
epochs over minibatches, and GAE across turns (``num_turns >= 1``).

Per-agent hyperparameters are named ``agent<i>.<name>`` (``agent1.actor_learning_rate``,
``agent0.lora_rank``); a bare name (``entropy_coef``) reads agent 0 and sets every agent.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch

from evollm.parallel import zero
from .base import build_config
from .member import Member
from ..utils.fields import documented
from .ppo import LLMPPO, LLMPPOConfig
from .ppo_update import learn_grouped
from ..rollout import SamplingConfig

#: team setting -> the per-agent field it sets (CoMLRL name -> LLMPPO name)
AGENT_FIELDS: dict[str, str] = {
    "actor_learning_rate": "lr_actor", "critic_learning_rate": "lr_critic", "weight_decay": "weight_decay",
    "adam_beta1": "adam_beta1", "adam_beta2": "adam_beta2", "adam_epsilon": "adam_epsilon",
    "max_grad_norm": "max_grad_norm", "mini_batch_size": "batch_size", "ppo_epochs": "update_epochs",
    "clip_coef": "clip_coef", "value_clip_range": "value_clip", "value_loss_coef": "vf_coef",
    "entropy_coef": "ent_coef", "advantage_normalization": "adv_whitening", "gamma": "gamma",
    "gae_lambda": "gae_lambda", "max_new_tokens": "max_output_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "do_sample": "do_sample", "use_separate_critic": "use_separate_critic",
    "beta": "beta", "seed": "seed", "target_kl": "target_kl",
}

#: per-agent hyperparameters evolution may change (as ``agent<i>.<name>``, or bare for every agent)
AGENT_MUTABLE: tuple[str, ...] = ("actor_learning_rate", "critic_learning_rate", "clip_coef", "value_clip_range",
                                  "entropy_coef", "value_loss_coef", "temperature", "top_p", "top_k", "gamma",
                                  "gae_lambda", "ppo_epochs", "mini_batch_size", "max_grad_norm", "lora_rank")


@dataclass
class IPPOConfig:
    """Settings of an IPPO team (CoMLRL's ``IPPOConfig`` names where they exist)."""

    num_agents: int = documented(2, "Agents per team.")
    num_turns: int = documented(1, "Rounds per episode; from round 2 on each agent sees the others' previous replies.")
    actor_learning_rate: float = documented(1e-4, "AdamW learning rate of each actor adapter.")
    critic_learning_rate: float | None = documented(None, "Learning rate of each critic adapter + value head (None: "
                                                    "the actor's starting rate, kept when actor_learning_rate "
                                                    "evolves).")
    weight_decay: float = documented(0.0, "AdamW weight decay.")
    adam_beta1: float = documented(0.9, "AdamW beta1.")
    adam_beta2: float = documented(0.999, "AdamW beta2.")
    adam_epsilon: float = documented(1e-8, "AdamW epsilon.")
    max_grad_norm: float | None = documented(1.0, "Gradient clipping per agent and param group (None: off).")
    rollout_buffer_size: int = documented(32, "Episodes (dataset rows) each team plays before an update.")
    mini_batch_size: int = documented(8, "Episodes per PPO minibatch.")
    ppo_epochs: int = documented(2, "Passes over the buffer per update.")
    target_kl: float | None = documented(None, "Stop an agent's epochs once an epoch's mean approx_kl exceeds it "
                                         "(None: off).")
    clip_coef: float | None = documented(0.2, "PPO ratio clip (1 +- clip_coef); None: no clipping.")
    value_clip_range: float | None = documented(0.2, "Value-loss clip around the old values; None: unclipped.")
    value_loss_coef: float = documented(0.5, "Weight of the value loss.")
    entropy_coef: float = documented(0.0, "Weight of the entropy bonus.")
    advantage_normalization: bool = documented(True, "Whiten advantages per agent and update.")
    gamma: float = documented(1.0, "Discount across turns.")
    gae_lambda: float = documented(0.95, "GAE lambda across turns.")
    max_new_tokens: int = documented(32, "Longest reply per turn.")
    temperature: float = documented(1.0, "Sampling temperature (the trained policy is the sampled one).")
    top_p: float = documented(1.0, "Nucleus sampling.")
    top_k: int = documented(0, "Top-k sampling (0: off).")
    do_sample: bool = documented(True, "Sample in training rollouts (evaluation is always greedy).")
    use_separate_critic: bool = documented(True, "Critic LoRA adapter + value head per agent; False: a value head "
                                           "on the actor.")
    value_head_hidden_dim: int | None = documented(None, "Hidden width of the value head on the actor (None: linear).")
    critic_value_head_hidden_dim: int | None = documented(None, "Hidden width of the separate critic's value head.")
    beta: float = documented(0.0, "Weight of the k3 KL penalty to the base model (adapters disabled).")
    max_model_len: int | None = documented(256, "Longest conversation an agent may see.")
    seed: int = documented(42, "Seed of minibatch shuffling.")
    agent_overrides: list[dict] = documented(default_factory=list,
                                             help="Per-agent settings, e.g. [{}, {'temperature': 0.8}].")
    output_dir: str = documented("runs/ippo", "Where IPPOTrainer writes the report and the best team.")
    num_train_epochs: float = documented(1.0, "IPPOTrainer: passes over train_dataset when max_steps is not given.")
    eval_interval: int = documented(10, "IPPOTrainer: updates between evaluations on the fixed eval set.")

    def validate(self) -> None:
        if self.num_agents < 1 or self.num_turns < 1:
            raise ValueError(f"num_agents and num_turns must be >= 1, got {self.num_agents}, {self.num_turns}")
        for name in ("rollout_buffer_size", "mini_batch_size", "ppo_epochs", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"IPPOConfig.{name} must be >= 1, got {getattr(self, name)}")
        if len(self.agent_overrides) > self.num_agents:
            raise ValueError(f"agent_overrides has {len(self.agent_overrides)} entries for {self.num_agents} agents")
        for i, over in enumerate(self.agent_overrides):
            unknown = sorted(set(over) - set(AGENT_FIELDS) - {"lora_rank"})
            if unknown:
                raise ValueError(f"agent_overrides[{i}] has unknown setting(s) {unknown}; valid: "
                                 f"{sorted(AGENT_FIELDS) + ['lora_rank']}")

    def agent_settings(self, i: int) -> dict[str, Any]:
        """The IPPOAgentConfig fields of agent ``i`` (team settings, then its overrides)."""
        team = {name: getattr(self, name) for name in AGENT_FIELDS}
        team.update({k: v for k, v in (self.agent_overrides[i] if i < len(self.agent_overrides) else {}).items()
                     if k != "lora_rank"})
        out = {AGENT_FIELDS[k]: v for k, v in team.items()}
        out["value_head_hidden_dim"] = (self.critic_value_head_hidden_dim if out["use_separate_critic"]
                                        else self.value_head_hidden_dim)
        out["max_model_len"] = self.max_model_len
        return out


@dataclass
class IPPOAgentConfig(LLMPPOConfig):
    """One agent's PPO settings (LLMPPO's, plus the IPPO ones; set through :class:`IPPOConfig`)."""

    use_separate_critic: bool = documented(True, "Critic LoRA adapter + value head per agent; False: a value head "
                                           "on the actor.")
    value_head_hidden_dim: int | None = documented(None, "Hidden width of the value head (None: linear).")
    do_sample: bool = documented(True, "Sample in training rollouts (evaluation is always greedy).")
    adam_beta1: float = documented(0.9, "AdamW beta1.")
    adam_beta2: float = documented(0.999, "AdamW beta2.")
    adam_epsilon: float = documented(1e-8, "AdamW epsilon.")

    def default_clip(self) -> tuple[float, float]:
        """A team's ``clip_coef=None``: the ratio is never clipped (offsets 1 and inf)."""
        return 1.0, math.inf


class IPPOAgent(LLMPPO):
    """One agent of a team: LLMPPO with an optional critic adapter, a (possibly MLP) value head and
    the PPO update of :mod:`evollm.algorithms.ppo_update` (agents with equal schedules share passes)."""

    config_cls = IPPOAgentConfig

    @property
    def ROLES(self) -> tuple[str, ...]:  # noqa: N802 - the base class reads it as a class constant
        return ("actor", "critic") if self.config.use_separate_critic else ("actor",)

    def _init_extra_modules(self) -> None:
        hidden = self.shared.model.get_base_model().config.hidden_size
        width = self.config.value_head_hidden_dim
        head = (torch.nn.Linear(hidden, 1) if not width else
                torch.nn.Sequential(torch.nn.Linear(hidden, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)))
        last = head if isinstance(head, torch.nn.Linear) else head[-1]
        torch.nn.init.zeros_(last.weight)  # V = 0 until the critic learns
        torch.nn.init.zeros_(last.bias)
        self.value_head = head.to(self.device)

    def _param_groups(self) -> list[dict]:
        c = self.config
        critic = list(self.value_head.parameters())
        if c.use_separate_critic:
            critic = self.shared.parameters(self.adapter_name("critic")) + critic
        return [{"name": "actor", "params": self.shared.parameters(self.adapter_name("actor")), "lr": c.lr_actor},
                {"name": "critic", "params": critic, "lr": c.lr_critic}]

    def _build_optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        # under a DeepSpeed ZeRO launch every param group goes into its own engine (evollm.parallel.zero)
        return zero.wrap(torch.optim.AdamW(self._param_groups(), weight_decay=c.weight_decay,
                                           betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_epsilon),
                         c.max_grad_norm, self.__dict__.get("optimizer"))

    def sampling_config(self, training: bool = True, group_size: int = 1) -> SamplingConfig:
        s = super().sampling_config(training, group_size)
        return dataclasses.replace(s, do_sample=training and self.config.do_sample)

    def learn(self, experiences) -> dict[str, float]:
        return learn_grouped([self], [experiences])[0]

    @classmethod
    def learn_population(cls, agents: Sequence["IPPOAgent"], experiences: Sequence) -> list[dict[str, float]]:
        """Agents whose update schedule agrees share every forward/backward pass (see ppo_update)."""
        return learn_grouped(agents, experiences)


class IPPOTeam(Member):
    """A team of cooperating agents: ONE population member.

    ``IPPOTeam(model, tokenizer, num_agents=2, actor_learning_rate=1e-3, ...)``: any :class:`IPPOConfig`
    field as a keyword, or ``config=IPPOConfig(...)``; ``lora_config`` is each agent's LoRA
    (``agent_overrides[i]["lora_rank"]`` gives agent ``i`` another rank)."""

    config_cls: ClassVar[type] = IPPOConfig
    #: teams take their ids from their own space on the shared base (their agents are members there)
    ID_SPACE: ClassVar[str] = "team"
    HAS_CRITIC: ClassVar[bool] = True

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, pad_token_id: int | None = None,
                 pad_token: str | None = None, eos_token_id: int | None = None, config: IPPOConfig | None = None,
                 hp_config=None, index: int | None = None, lora_config=None, lora_configs: Sequence | None = None,
                 device=None, **settings):
        from ..adapters.shared import default_lora_config

        self.config = build_config(IPPOConfig, config, settings)
        if tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
            pad_token = tokenizer.pad_token if pad_token is None else pad_token
            eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if pad_token_id is None:
            raise ValueError("IPPOTeam needs a tokenizer or pad_token_id")
        base_lora = lora_config if lora_config is not None else default_lora_config()
        self.agents: list[IPPOAgent] = []
        for i in range(self.config.num_agents):
            lora = copy.deepcopy(lora_configs[i] if lora_configs is not None else base_lora)
            over = self.config.agent_overrides[i] if i < len(self.config.agent_overrides) else {}
            if "lora_rank" in over:
                r = int(over["lora_rank"])
                lora.lora_alpha, lora.r = lora.lora_alpha * r / lora.r, r  # same scale alpha / r
            self.agents.append(IPPOAgent(model, pad_token_id, pad_token, eos_token_id=eos_token_id, lora_config=lora,
                                         device=device, **self.config.agent_settings(i)))
        self.index = self.shared.reserve_index(index, self.ID_SPACE)
        self._init_member(hp_config)

    # ------------------------------------------------------------------ identity
    @property
    def shared(self):
        return self.agents[0].shared

    @property
    def device(self) -> torch.device:
        return self.shared.device

    @property
    def num_agents(self) -> int:
        return len(self.agents)

    @property
    def pad_token_id(self) -> int:
        return self.agents[0].pad_token_id

    @property
    def lora_rank(self) -> int:
        """The largest rank of the agents' adapters."""
        return max(a.lora_rank for a in self.agents)

    def __repr__(self) -> str:
        return f"IPPOTeam(index={self.index}, agents={[a.index for a in self.agents]}, ranks={[a.lora_rank for a in self.agents]})"

    # ------------------------------------------------------------------ hyperparameters
    @staticmethod
    def evolvable_names(config: IPPOConfig) -> tuple[str, ...]:
        """Hyperparameter names a team with ``config`` can evolve: every per-agent name, bare (all agents)
        or as ``agent<i>.<name>``."""
        return AGENT_MUTABLE + tuple(f"agent{i}.{n}" for i in range(config.num_agents) for n in AGENT_MUTABLE)

    def mutable_hyperparameters(self) -> tuple[str, ...]:
        return self.evolvable_names(self.config)

    def _resolve(self, name: str) -> tuple[list[IPPOAgent], str]:
        agents, short = self.agents, name
        if name.startswith("agent") and "." in name:
            head, short = name.split(".", 1)
            try:
                agents = [self.agents[int(head[5:])]]
            except (ValueError, IndexError):
                agents = []
        if not agents or short not in AGENT_MUTABLE:
            raise ValueError(f"{name!r} cannot evolve on IPPOTeam; valid names: AGENT or agent<i>.AGENT for i < "
                             f"{self.num_agents}, AGENT in {list(AGENT_MUTABLE)}")
        return agents, short

    def get_hyperparameter(self, name: str):
        agents, short = self._resolve(name)
        if short == "lora_rank":
            return agents[0].lora_rank
        return agents[0].get_hyperparameter(AGENT_FIELDS[short])

    def set_hyperparameter(self, name: str, value) -> None:
        """Set a per-agent (``agent1.clip_coef``) or team-wide (``clip_coef``) value; it reaches that
        agent's optimizer (learning rates), loss (clip, coefficients, GAE) or sampler (temperature)."""
        agents, short = self._resolve(name)
        for agent in agents:
            if short == "lora_rank":
                agent.set_lora_rank(int(value))
            else:
                agent.set_hyperparameter(AGENT_FIELDS[short], value)

    def set_lora_rank(self, r: int) -> None:
        for agent in self.agents:
            agent.set_lora_rank(int(r))

    def agent_hyperparameters(self) -> dict[str, Any]:
        """Every per-agent hyperparameter as ``{"agent<i>.<name>": value}`` (report columns)."""
        return {f"agent{i}.{n}": self.get_hyperparameter(f"agent{i}.{n}")
                for i in range(self.num_agents) for n in AGENT_MUTABLE}

    # ------------------------------------------------------------------ population methods
    def clone(self, index: int | None = None, wrap: bool = True) -> "IPPOTeam":
        """A new team on the same base: every agent's adapters, value head and optimizer state copied
        in memory; settings and hooks copied; like every clone, an empty fitness history and
        ``parent_index`` this team's id."""
        new = object.__new__(type(self))
        new.agents = [a.clone() for a in self.agents]
        new.config = copy.deepcopy(self.config)
        new.index = self.shared.reserve_index(index, self.ID_SPACE)
        return self._start_clone(new)

    def _free(self) -> None:
        for agent in self.agents:
            agent.release()

    def trainable_parameters(self) -> list[torch.Tensor]:
        """Every tensor the team trains: those of all its agents."""
        return [p for agent in self.agents for p in agent.trainable_parameters()]

    # ------------------------------------------------------------------ learning
    def learn(self, experiences: Sequence) -> list[dict[str, float]]:
        """One PPO update of every agent, ``experiences[i]`` agent ``i``'s episodes as
        ``(ids, action_masks, turn_ids, rewards[B, K])``; agents with equal schedules share passes."""
        if len(experiences) != self.num_agents:
            raise ValueError(f"got experiences for {len(experiences)} agents, the team has {self.num_agents}")
        self.steps += 1
        return learn_grouped(self.agents, experiences)

    @classmethod
    def learn_population(cls, teams: Sequence["IPPOTeam"], experiences: Sequence[Sequence]) -> list[list[dict]]:
        """Update every agent of every team; agents whose schedules agree share passes across teams."""
        flat_agents = [a for t in teams for a in t.agents]
        flat = learn_grouped(flat_agents, [e for exp in experiences for e in exp])
        out, k = [], 0
        for t in teams:
            t.steps += 1
            out.append(flat[k:k + t.num_agents])
            k += t.num_agents
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path) -> Path:
        """``team.json`` + ``agent_<i>/`` per agent (its actor adapter in ``agent_<i>/adapter`` loads with
        ``PeftModel.from_pretrained``; critic, value head and optimizer as safetensors), atomically: a
        complete folder with a manifest, or nothing."""
        from evollm.utils.atomic import atomic_folder

        with atomic_folder(path, "team") as tmp:
            self.write_checkpoint(tmp)
        return Path(path)

    def write_checkpoint(self, path: Path) -> Path:
        """The team's files into ``path`` (what :meth:`save_checkpoint` writes; a run checkpoint writes
        every team this way inside its own atomic folder)."""
        from evollm.utils.atomic import jsonable, write_json
        from evollm.algorithms.checkpoint import save_agent

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for i, agent in enumerate(self.agents):
            save_agent(agent, path / f"agent_{i}")
        info = {"algorithm": type(self).__name__, "index": self.index, "config": jsonable(self.config),
                "hp_config": self.hp_config.to_dict() if self.hp_config is not None else None,
                "fitness": [jsonable(f) for f in self.fitness], "scores": [jsonable(s) for s in self.scores],
                "steps": self.steps, "agents": [a.index for a in self.agents], "lora_rank": self.lora_rank,
                "pad_token_id": self.pad_token_id, "pad_token": self.agents[0].pad_token,
                "eos_token_id": self.agents[0].eos_token_id, "default_founder": bool(self.default_founder)}
        write_json(path / "team.json", info)
        return path

    def load_checkpoint(self, path, merge_lora_configs: bool = False, verify_manifest: bool = True) -> None:
        """Load a team checkpoint into this live team (same number of agents)."""
        from evollm.algorithms.checkpoint import load_agent

        path = Path(path)
        info = _read_team(path)
        if len(info["agents"]) != self.num_agents:
            raise ValueError(f"checkpoint at {path} has {len(info['agents'])} agents, this team {self.num_agents}")
        for i, agent in enumerate(self.agents):
            load_agent(agent, path / f"agent_{i}", merge_lora_configs=merge_lora_configs,
                       verify_manifest=verify_manifest)
        self.config = dataclasses.replace(self.config, **info["config"])
        if info.get("hp_config") is not None:
            from ..hpo import HyperparameterConfig
            self.hp_config = HyperparameterConfig.from_dict(info["hp_config"])
        self.fitness = [f if f is not None else math.nan for f in info["fitness"]]
        self.scores = [s if s is not None else math.nan for s in info["scores"]]
        self.steps = int(info["steps"])
        self.default_founder = bool(info.get("default_founder", self.default_founder))

    @classmethod
    def load(cls, path, model, tokenizer=None, **kwargs) -> "IPPOTeam":
        """A new team on ``model`` (the base it was trained on) from a checkpoint, each agent at its saved rank."""
        from peft import LoraConfig

        path = Path(path)
        info = _read_team(path)
        configs = []
        for i in range(len(info["agents"])):
            lora = LoraConfig.from_pretrained(str(path / f"agent_{i}" / "adapter"))
            lora.inference_mode = False
            configs.append(lora)
        if tokenizer is None:
            for key in ("pad_token_id", "pad_token", "eos_token_id"):
                kwargs.setdefault(key, info.get(key))
        team = cls(model, tokenizer, config=IPPOConfig(**info["config"]), lora_configs=configs, **kwargs)
        team.load_checkpoint(path)
        return team


def _read_team(path: Path) -> dict:
    file = path / "team.json"
    if not file.exists():
        raise FileNotFoundError(f"{path} is not a team checkpoint (no team.json)")
    info = json.loads(file.read_text())
    if info.get("algorithm") != "IPPOTeam":
        raise ValueError(f"checkpoint at {path} holds a {info.get('algorithm')}, not an IPPOTeam")
    return info
