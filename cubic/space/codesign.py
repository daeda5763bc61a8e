"""A space's `codesign:` section: the cluster as knobs of a simulated study, and what it optimises.

A team that books hardware asks which cluster trains its model to its quality target soonest and
which for least money; the answer needs the configuration tuned on each (a plan tuned for 8 GPUs is
not the one for 256). The section lists the clusters a study may choose among, each a value made of

- a node (`nodes_from`: a shipped preset or a cluster file, e.g. `h100-8`, `gb200-nvl72`);
- a size in GPUs (`gpus`), the node count following from the node's devices;
- optionally an NVLink domain (`nvlink_domains`: `node`, the node's own, or GPUs that share its
  NVLink, an NVLink Switch System's; the node count then follows from the domain);
- a fabric (`fabrics`: named; each a preset whose network it takes, plus what differs: bandwidth,
  latency, oversubscription, in-network reduction);

and the objectives (`OBJECTIVES`), each computed from a simulated trial by
`cubic.codesign.objectives`. Time to train is the workload's samples to its quality target at a
fixed global batch, with its evaluations (`TimeToTrain`); a knob that changes numerics would change
those samples, so a co-design space's knobs are layout-only (checked at load). Cost is the user's
price per GPU-hour.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from cubic_harness.schema import Strict

Pos = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PosInt = Annotated[int, Field(ge=1)]
#: objective -> (direction, unit): what a front is drawn in
OBJECTIVES: dict[str, tuple[str, str]] = {
    "time_to_train": ("minimize", "hours"),
    "cost": ("minimize", "price units"),
    "qps": ("maximize", "samples/s"),
    "memory_headroom": ("maximize", "fraction of device memory left"),
}
Objective = Literal[tuple(OBJECTIVES)]  # type: ignore[valid-type]


def _domains(v: Any) -> Any:
    """Each NVLink domain is `node` or a GPU count, said in one line naming the value (a union's
    members would each complain, under pydantic's names for them)."""
    for x in v if isinstance(v, list) else []:
        if x != "node" and (type(x) is not int or x < 1):
            raise ValueError(
                f"{x!r} is not an NVLink domain: node (the node's own) or a number of GPUs >= 1"
            )
    return v


Domains = Annotated[list[PosInt | Literal["node"]], Field(min_length=1), BeforeValidator(_domains)]


class TimeToTrain(Strict):
    """The samples to the quality target, and the evaluations on the way (MLPerf's rules)."""

    samples: Pos = Field(description="samples trained until the quality target is reached")
    global_batch: PosInt = Field(
        description="the global batch those samples were measured at; each trial "
        "runs it (per-GPU batch = global_batch / GPUs)"
    )
    eval_every: Pos | None = Field(
        None, description="samples between evaluations; absent: none counted"
    )
    eval_samples: PosInt = Field(0, description="samples one evaluation reads")
    eval_speedup: Pos = Field(
        3.0, description="an evaluation sample's speed over a training one's (forward only)"
    )
    fixed_s: Annotated[float, Field(ge=0)] = Field(
        0.0, description="a run's fixed seconds (start-up, data loading before the clock)"
    )
    source: str = Field("", description="where these figures come from")


class Fabric(Strict):
    """A network: a preset's `network` (its `from`), with the keys given here over it."""

    from_: str | None = Field(
        None,
        alias="from",
        description="a shipped preset or cluster file whose "
        "network this starts from; absent: the node's own",
    )
    bandwidth_gbs: Pos | None = None
    bandwidth_scale: Pos | None = Field(
        None,
        description="the network's bandwidth times this (the same "
        "NICs on another fabric); absent: as stated",
    )
    latency_us: Annotated[float, Field(ge=0)] | None = None
    oversubscription: Annotated[float, Field(ge=1)] | None = None
    in_network_reduction: bool | None = None

    def apply(self, net: dict[str, Any]) -> dict[str, Any]:
        """`net` (a cluster file's `network`) on this fabric."""
        out = {
            **net,
            **{
                k: v
                for k, v in self.model_dump(exclude={"from_", "bandwidth_scale"}).items()
                if v is not None
            },
        }
        if self.bandwidth_scale is not None:
            out["bandwidth_gbs"] = out["bandwidth_gbs"] * self.bandwidth_scale
        return out


class CodesignSection(Strict):
    """`codesign:` of a search space (`cubic codesign`): which clusters, and what to optimise."""

    nodes_from: Annotated[list[str], Field(min_length=1)] = Field(
        description="the nodes to build clusters of: shipped presets or cluster files"
    )
    gpus: Annotated[list[PosInt], Field(min_length=1)] = Field(description="cluster sizes in GPUs")
    fabrics: dict[str, Fabric] = Field(
        default_factory=lambda: {"node's own": Fabric()},
        description="named networks; absent: each node's own",
    )
    sites: Annotated[list[PosInt], Field(min_length=1)] = Field(
        default_factory=lambda: [1],
        description="data centers the nodes are split between (the "
        "tier above the pods); more than 1 needs interconnect_from",
    )
    nvlink_domains: Domains | None = Field(
        None,
        description="GPUs that share the node's NVLink (an NVLink Switch System's domain), "
        "each at least the node's own; node: the node's own. Absent: each node's own, and no "
        "cluster.nvlink_domain parameter",
    )
    interconnect_from: str | None = Field(
        None,
        description="a preset or cluster file whose datacenters: (the interconnect between "
        "sites: bandwidth, latency, oversubscription) the sites take",
    )
    price_per_gpu_hour: dict[str, Pos] = Field(
        default_factory=dict,
        description="per entry of nodes_from, what one GPU costs an hour (yours: "
        "presets carry none)",
    )
    objectives: Annotated[list[Objective], Field(min_length=1, max_length=3)] = Field(
        default_factory=lambda: ["time_to_train", "cost"]
    )
    time_to_train: TimeToTrain | None = None

    @model_validator(mode="after")
    def _objectives_have_data(self) -> CodesignSection:
        if "time_to_train" in self.objectives and self.time_to_train is None:
            raise ValueError(
                "objective time_to_train needs codesign.time_to_train (samples, global_batch)"
            )
        if "cost" in self.objectives and self.time_to_train is None:
            raise ValueError("objective cost needs codesign.time_to_train (the hours it prices)")
        if "cost" in self.objectives:
            missing = [n for n in self.nodes_from if n not in self.price_per_gpu_hour]
            if missing:
                raise ValueError(
                    f"objective cost needs price_per_gpu_hour for every node: none for {missing}"
                )
        if any(k > 1 for k in self.sites) and not self.interconnect_from:
            raise ValueError(
                f"sites {self.sites} needs codesign.interconnect_from (a preset with "
                "datacenters:, e.g. h100-16384-4dc)"
            )
        if len(set(self.objectives)) != len(self.objectives):
            raise ValueError(f"objectives {self.objectives}: each at most once")
        return self
