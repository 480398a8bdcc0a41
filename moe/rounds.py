"""FoMoE rounds: K local steps on every site, then synchronisation (docs/fomoe.md,
"Synchronisation (one round)").

All sites run in one jitted program: their states are stacked along a leading site axis (sharded over the
(replica, block) site mesh of `moe.federation`), the local step is the core train step under `jax.vmap`, the K
steps are a `lax.scan`, and the synchronisation averages

  * dense parameters over all M sites and expert parameters over their O_e-site replica group, then
  * "local_adamw": also both AdamW moments (the paper's better choice; about 3x the bytes); the averaged
    parameters start the next round;
  * "diloco": outer gradient Delta = theta_start - theta_avg and an outer Nesterov step (`optim.diloco_outer`);
    the inner AdamW state stays with each site (DES-LOC, moe.desloc: its moments averaged on their own periods);
  * "spes": SPES (moe.spes): every site holds every expert (O_e = M) and trains only its own; the dense parameters
    are averaged, each expert is all-gathered from its owner, an expert-merging warm-up follows; the optimizer
    state stays with each site.

Low-bit synchronisation (`wire`, a core.codec.WireFormat other than float32): what a site sends is its change since
the round's start (DiLoCo's outer gradient; LocalAdamW's parameter and moment deltas), quantised on the wire and
averaged in float32 (moe.lowbit_sync); with `error_feedback` each site keeps what its encoding dropped, in
FederatedState.feedback, and adds it to its next round's send.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from core import train as train_lib
from core.codec import WireFormat
from core.mesh import put_global
from core.model import split_params
from moe import desloc, federation, lowbit_sync, spes

__all__ = [
    "OUTER_METHODS",
    "FederatedState",
    "averaged_moments",
    "init_sites",
    "make_round",
    "make_round_parts",
    "round_start",
    "site_batches",
    "start_of",
]

OUTER_METHODS = ("local_adamw", "diloco", "spes")


class FederatedState(NamedTuple):
    """train: the stacked per-site TrainState (its parameters are the synchronised ones a round starts from, its
    step counts the local steps done, K per round); outer: the outer optimizer's stacked state (DiLoCo momentum;
    empty for LocalAdamW); feedback: low-bit synchronisation's error feedback, {"params": ..., "opt_state": ...}
    float32 per site (moe.lowbit_sync.init_feedback; "opt_state" for LocalAdamW only), or () without it; anchor:
    under streaming synchronisation (moe.streaming) of a method that needs the state a synchronisation starts from
    (`round_start`: DiLoCo, low-bit), every parameter's (and moment's) value after its fragment's last
    synchronisation, shaped like `start_of`'s result and equal within each group; () otherwise (the round's start
    is that value)."""

    train: train_lib.TrainState
    outer: Any
    feedback: Any = ()
    anchor: Any = ()


def init_sites(
    global_model: nnx.Module,
    site_model: nnx.Module,
    placement,
    optimizer: optax.GradientTransformation,
    outer: optax.GradientTransformation | None,
    mesh,
    seed: int,
    *,
    error_feedback: bool = False,
    anchor: str | None = None,
) -> tuple[Any, FederatedState]:
    """Every site's initial state from one model holding all experts, so replicas of an expert start equal.

    Args:
      global_model: the model with all N_e experts per MoE layer (its initial weights are the federation's).
      site_model: the same architecture built with `resident=placement.experts[0]` (its graph serves all sites).
      placement: a `moe.placement.Placement`.
      outer: the outer optimizer for DiLoCo, or None.
      mesh: the site mesh, or None to leave the state on the default device (e.g. to restore a checkpoint into).
      error_feedback: start low-bit synchronisation's error feedback (zeros; `make_round`'s wire and error_feedback).
      anchor: keep FederatedState.anchor, `round_start`'s "params" or "params_and_opt_state" (moe.streaming's
        `anchor_kind`), starting as copies of the initial values; None: none.
    Returns:
      (site graphdef, FederatedState with every leaf's leading axis M sharded over the site mesh).
    """
    _, params, _ = split_params(global_model)
    graphdef, _, rest = split_params(site_model)
    params = federation.to_sites(params, placement.experts)
    rest = federation.to_sites(rest, placement.experts)
    sites = placement.sites
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.PRNGKey(seed), s))(jnp.arange(sites))
    train = train_lib.TrainState(jnp.zeros((sites,), jnp.int32), params, rest, jax.vmap(optimizer.init)(params), keys)
    outer_state = jax.vmap(outer.init)(params) if outer is not None else ()
    state = FederatedState(train, outer_state, _init_feedback(optimizer, train, outer is None, placement.overlap))
    if not error_feedback:
        state = state._replace(feedback=())
    if anchor not in (None, "params", "params_and_opt_state"):
        raise ValueError(f"anchor = {anchor!r}; allowed: None, 'params', 'params_and_opt_state' (round_start's).")
    if anchor is not None:
        kept = train.params if anchor == "params" else (train.params, train.opt_state)
        state = state._replace(anchor=jax.tree.map(jnp.copy, kept))
    if mesh is None:
        return graphdef, state
    # each process places only its sites' slices: jax.device_put would send each process's whole copy to the others
    return graphdef, put_global(state, federation.site_shardings(state, mesh))


def make_round(
    graphdef,
    optimizer: optax.GradientTransformation,
    mesh,
    *,
    method: str,
    outer: optax.GradientTransformation | None = None,
    loss_fn: Callable = train_lib.lm_loss,
    state_metrics: train_lib.StateMetrics | None = None,
    wire: WireFormat | None = None,
    error_feedback: bool = False,
    second_moments: str = "sent",
    moments: tuple[str, ...] | None = None,
    feedback_decay: float = 1.0,
    merge: tuple[float, int] = (0.0, 1),
) -> jax.stages.Wrapped:
    """A jitted `(state, tokens [K, M, B_site, T + 1]) -> (state, metrics)`: K local steps on every site, then the
    synchronisation of `method`. Metrics are the train-step metrics of every step and site, [K, M] each (averaged
    on the host, so the program's only cross-site collectives are the synchronisation's). `wire`: the wire format of
    low-bit synchronisation (None or float32: today's exact mean); `error_feedback` keeps what it drops (the state
    from `init_sites(..., error_feedback=True)`), decayed by `feedback_decay` beta before it is added to the next
    send (SparseLoCo's e <- beta e + Delta; 1: kept whole). `second_moments`: LocalAdamW's second moments "sent" (as
    `second_moment_wire` says) or kept "local" to each site. `moments`: the moment groups of the (inner) optimizer
    state this synchronisation averages (None: the method's own, `averaged_moments`; DES-LOC's schedule,
    `moe.desloc.own_cycle`, names others; the rest stay each site's own; DiLoCo's in float32 only). `merge`: SPES's
    expert-merging warm-up (alpha_0, steps) (moe.spes.merge_alpha; alpha_0 = 0: none).
    """
    local_steps, sync = _round_parts(
        graphdef, optimizer, mesh, method, outer, loss_fn, state_metrics, wire, error_feedback, second_moments, None,
        moments=moments, feedback_decay=feedback_decay, merge=merge,
    )  # fmt: skip

    def round_fn(state: FederatedState, tokens: jax.Array):
        train, metrics = local_steps(state.train, tokens)
        return sync(start_of(state.train, method, wire), state.outer, state.feedback, train), metrics

    return jax.jit(round_fn, donate_argnums=0)


def make_round_parts(
    graphdef,
    optimizer: optax.GradientTransformation,
    mesh,
    *,
    method: str,
    outer: optax.GradientTransformation | None = None,
    loss_fn: Callable = train_lib.lm_loss,
    state_metrics: train_lib.StateMetrics | None = None,
    wire: WireFormat | None = None,
    error_feedback: bool = False,
    second_moments: str = "sent",
    fragment: Any = None,
    anchored: bool = False,
    donate: bool = True,
    moments: tuple[str, ...] | None = None,
    feedback_decay: float = 1.0,
    merge: tuple[float, int] = (0.0, 1),
) -> tuple[jax.stages.Wrapped, jax.stages.Wrapped]:
    """`make_round`'s round as two jitted programs, so that a driver can time its compute and its synchronisation
    apart (experiments.federated); `sync(start, outer, feedback, *local(params, others, tokens)[:1])` is the round:

        local(params, others, tokens) -> (train, metrics)   K local steps; `others`: the TrainState, params None
        sync(start, outer, feedback, train) -> FederatedState   the synchronisation; `start`: what the round started
                                                             from that it needs (`round_start`), else None

    Both donate what the round no longer needs (`start` is kept through the local steps), unless `donate` is False
    (moe.streaming's overlapped rounds read the state a round started from after both). `fragment`: a tree of bools
    like the parameters, True for those this synchronisation averages (with their optimizer state; moe.streaming);
    None: all of them. DiLoCo's outer step then moves the fragment's parameters and outer momentum only; the
    others keep the sites' own values. `anchored`: `start` is FederatedState.anchor (streaming), and the returned
    state's anchor is it with the fragment's synchronised values. `moments`, `feedback_decay`, `merge`: as
    `make_round`'s."""
    local_steps, sync = _round_parts(
        graphdef, optimizer, mesh, method, outer, loss_fn, state_metrics, wire, error_feedback, second_moments,
        fragment, anchored, moments, feedback_decay, merge,
    )  # fmt: skip
    kept = round_start(method, wire)
    donated = (0, 1) if kept is None else (1,) if kept == "params" else ()
    local = jax.jit(
        lambda params, others, tokens: local_steps(others._replace(params=params), tokens),
        donate_argnums=donated if donate else (),
    )
    return local, jax.jit(sync, donate_argnums=(0, 1, 2, 3) if donate else ())


def round_start(method: str, wire: WireFormat | None) -> str | None:
    """What the synchronisation needs of the state the round started from: "params" (DiLoCo's outer gradient, or
    low-bit DiLoCo's deltas), "params_and_opt_state" (low-bit LocalAdamW: parameter and moment deltas), or None."""
    if wire is not None and not wire.exact:
        return "params" if method == "diloco" else "params_and_opt_state"
    return "params" if method == "diloco" else None


def start_of(train: train_lib.TrainState, method: str, wire: WireFormat | None):
    """The part of `train` (the round's starting state) that the synchronisation needs (`round_start`), or None."""
    kept = round_start(method, wire)
    return None if kept is None else train.params if kept == "params" else (train.params, train.opt_state)


def _init_feedback(optimizer, train: train_lib.TrainState, local_adamw: bool, overlap: int) -> dict[str, Any]:
    """Error feedback for the parameters and (LocalAdamW) the first moments: second moments travel in a per-element
    format or not at all (`second_moment_wire`)."""
    sites = train.step.shape[0]
    flags = federation.expert_flags(train.params)
    out = {"params": lowbit_sync.init_feedback(train.params, flags, sites, overlap)}
    if local_adamw:
        first, _ = split_second_moments(moment_flags(optimizer, train.opt_state, train.params), train.opt_state)
        out["opt_state"] = lowbit_sync.init_feedback(train.opt_state, first, sites, overlap)
    return out


SECOND_MOMENTS = ("sent", "local")
SECOND_MOMENT_FIELDS = ("nu", "nu_max")  # optax's and optim's names of Adam's second moment (and AMSGrad's max)


def split_second_moments(flags: Any, opt_state: Any) -> tuple[Any, Any]:
    """`moment_flags`' tree split in two: (every flag but the second moments', None there; the second moments' flags
    alone). A second moment is a leaf under a state field named in SECOND_MOMENT_FIELDS (optax.ScaleByAdamState.nu,
    optim's HFAdamState.nu): positive, with a dynamic range a block scale cannot hold."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]
    leaves = federation.leaf_flags(flags, opt_state)
    is_second = [any(getattr(k, "name", None) in SECOND_MOMENT_FIELDS for k in p) for p in paths]
    treedef = jax.tree.structure(opt_state)
    first = jax.tree.unflatten(treedef, [None if n else f for f, n in zip(leaves, is_second)])
    second = jax.tree.unflatten(treedef, [f if n else None for f, n in zip(leaves, is_second)])
    return first, second


def sent_moments(optimizer, train: train_lib.TrainState, fragment: Any, moments, wire, second_moments: str):
    """What a LocalAdamW synchronisation averages of the optimizer state: (first-moment flags, None everywhere when
    `moments` leaves "first" out (DES-LOC); second-moment flags; the second moments' wire, None when they are not
    sent: "second" left out, or kept "local"). `fragment`: `moment_flags`'."""
    first, second = split_second_moments(
        moment_flags(optimizer, train.opt_state, train.params, fragment), train.opt_state
    )
    if "first" not in moments:
        first = jax.tree.map(lambda _: None, first)
    return first, second, second_moment_wire(wire, second_moments) if "second" in moments else None


def second_moment_wire(wire: WireFormat | None, second_moments: str) -> WireFormat | None:
    """How LocalAdamW's second moments travel: not at all ("local": each site keeps its own); else in the sync
    format when that is per-element (float32, bf16), and as bf16 under a block format (int8, fp4, int4): a block
    scale set by the block's largest value would round a small second moment's change to zero or below zero, and
    Adam divides by its square root (int8 LocalAdamW diverged so)."""
    if second_moments not in SECOND_MOMENTS:
        raise ValueError(f"second_moments = {second_moments!r}; allowed: {list(SECOND_MOMENTS)}.")
    if second_moments == "local":
        return None
    if wire is None or not wire.scaled:
        return wire or WireFormat("float32")
    return WireFormat("bf16")


def _round_parts(
    graphdef,
    optimizer,
    mesh,
    method,
    outer,
    loss_fn,
    state_metrics,
    wire,
    error_feedback,
    second_moments,
    fragment,
    anchored=False,
    moments=None,
    feedback_decay=1.0,
    merge=(0.0, 1),
) -> tuple[Callable, Callable]:
    """(local_steps(train, tokens) -> (train, metrics), sync(start, outer_state, feedback, train) -> FederatedState)."""
    if method not in OUTER_METHODS:
        raise ValueError(f"outer method = {method!r}; allowed: {list(OUTER_METHODS)}.")
    moments = averaged_moments(method, moments)
    if (method == "diloco") != (outer is not None):
        raise ValueError("method 'diloco' needs its outer optimizer (optim.diloco_outer); the others take none.")
    lowbit = wire is not None and not wire.exact
    if method == "diloco" and moments and lowbit:
        raise ValueError(f"moments = {moments!r} with method 'diloco': DiLoCo's inner moments average in float32.")
    if method == "spes" and (lowbit or fragment is not None or anchored):
        raise ValueError("method 'spes' synchronises in float32, all parameters every round (no wire, fragment).")
    if (merge[0] and method != "spes") or merge[0] < 0 or merge[1] < 1:
        raise ValueError(f"merge = {merge}: (alpha >= 0, steps >= 1), alpha > 0 only for method 'spes'.")
    if error_feedback and not lowbit:
        raise ValueError("error_feedback needs a low-bit wire format: float32 synchronisation drops nothing.")
    if not 0.0 < feedback_decay <= 1.0 or (feedback_decay != 1.0 and not error_feedback):
        raise ValueError(f"feedback_decay = {feedback_decay}; allowed: (0, 1], and 1 without error_feedback.")
    step = train_lib.train_step_fn(graphdef, optimizer, loss_fn, state_metrics=state_metrics)
    # one site's K steps (tokens [K, B_site, T + 1]), on its own device (federation.per_site)
    local_steps = federation.per_site(lambda train, tokens: jax.lax.scan(step, train, tokens), mesh, (0, 1), (0, 1))

    def sync(start: Any, outer_state: Any, feedback: Any, train: train_lib.TrainState) -> FederatedState:
        if method == "spes":
            return FederatedState(train._replace(params=spes_sync(train)), outer_state, feedback, ())
        flags = masked_flags(federation.expert_flags(train.params), train.params, fragment)
        first, second, nu_wire = sent_moments(optimizer, train, fragment, moments, wire, second_moments)
        sent = _union(first, second if nu_wire is not None else None, train.opt_state)
        opt_state = train.opt_state
        if lowbit:
            assert wire is not None
            start_params, start_opt = (start, None) if method == "diloco" else start
            # every site's own key, folded with the round (its step count): resumed runs repeat the draws
            keys = jax.vmap(lambda k, t: jax.random.fold_in(jax.random.fold_in(k, 0x5EC0), t))(train.key, train.step)
            fb = feedback or {}
            averaged, fb_params = lowbit_sync.compressed_average(
                train.params, start_params, flags, mesh, wire, keys, fb.get("params"), feedback_decay
            )
            new_feedback: Any = {"params": fb_params} if feedback else ()
            if method == "local_adamw":
                moment_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys)
                fb_opt = fb.get("opt_state")
                if _any(first, train.opt_state):
                    opt_state, fb_opt = lowbit_sync.compressed_average(
                        train.opt_state, start_opt, first, mesh, wire, moment_keys, fb_opt, feedback_decay
                    )
                if nu_wire is not None:  # second moments in a per-element format, after the first moments
                    opt_state, _ = lowbit_sync.compressed_average(
                        opt_state, start_opt, second, mesh, nu_wire, moment_keys, None
                    )
                if feedback:
                    new_feedback["opt_state"] = fb_opt
        else:
            averaged, new_feedback = federation.average(train.params, flags, mesh), feedback
            if _any(sent, train.opt_state):  # LocalAdamW's moments, or DES-LOC's of DiLoCo's inner optimizer
                opt_state = federation.average(train.opt_state, sent, mesh)
        in_fragment = [f is not None for f in federation.leaf_flags(flags, train.params)]
        if method == "local_adamw":
            params = averaged
        else:
            assert outer is not None  # checked above: diloco has its outer optimizer
            delta = jax.tree.map(lambda s, a: s - a, start, averaged)
            updates, stepped = jax.vmap(outer.update)(delta, outer_state, start)
            params = _where(in_fragment, optax.apply_updates(start, updates), train.params)
            in_tree = jax.tree.unflatten(jax.tree.structure(start), in_fragment)  # (a step count steps every time)
            momentum = train_lib.optimizer_state_like(outer, outer_state, start, in_tree, True)
            outer_state = _where(jax.tree.leaves(momentum), stepped, outer_state)
        anchor: Any = ()
        if anchored:  # the fragment's synchronised values become its anchor
            if method == "diloco":
                anchor = _where(in_fragment, params, start)
            else:
                this_round = _union(first, second if "second" in moments else None, train.opt_state)
                synced = [f is not None for f in federation.leaf_flags(this_round, train.opt_state)]
                anchor = (_where(in_fragment, params, start[0]), _where(synced, opt_state, start[1]))
        return FederatedState(train._replace(params=params, opt_state=opt_state), outer_state, new_feedback, anchor)

    def spes_sync(train: train_lib.TrainState) -> Any:
        dims = spes.expert_matrices(train.params)
        dense = [None if d >= 0 else False for d in jax.tree.leaves(dims)]  # routers too: averaged over all sites
        averaged = federation.average(train.params, jax.tree.unflatten(jax.tree.structure(dims), dense), mesh)
        params = spes.broadcast_owned(averaged, dims, mesh)
        if merge[0] == 0:
            return params
        merged = lambda p, step: spes.merge_experts(p, dims, spes.merge_alpha(step, *merge))  # noqa: E731
        return federation.per_site(merged, mesh, (0, 0))(params, train.step)

    return local_steps, sync


def averaged_moments(method: str, moments: tuple[str, ...] | None) -> tuple[str, ...]:
    """The moment groups (of moe.desloc.MOMENTS) a synchronisation of `method` averages: `moments`, or None for the
    method's own (`moe.desloc.own_cycle` at periods (1, 1): LocalAdamW both; DiLoCo, SPES none). ValueError naming
    the value for another group, or moments for SPES (which keeps the optimizer state on each site)."""
    if moments is None:
        return desloc.own_cycle(method, (1, 1))[0]
    if not set(moments) <= set(desloc.MOMENTS):
        raise ValueError(f"moments = {moments!r}; allowed: a subset of {list(desloc.MOMENTS)}.")
    if moments and method == "spes":
        raise ValueError(f"moments = {moments!r} with method 'spes': SPES keeps the optimizer state on each site.")
    return tuple(moments)


def _union(a: Any, b: Any, tree: Any) -> Any:
    """Flags like `tree`'s leaves: `a`'s where set, else `b`'s (None: neither; `b` None: `a`)."""
    left = federation.leaf_flags(a, tree)
    right = federation.leaf_flags(b, tree) if b is not None else [None] * len(left)
    return jax.tree.unflatten(jax.tree.structure(tree), [x if x is not None else y for x, y in zip(left, right)])


def _any(flags: Any, tree: Any) -> bool:
    """Whether `flags` (like `tree`) averages any leaf."""
    return any(f is not None for f in federation.leaf_flags(flags, tree))


def _where(keep: list[bool], chosen: Any, other: Any) -> Any:
    """`chosen`'s leaves where `keep` (one bool per leaf) holds, `other`'s elsewhere."""
    leaves = [c if k else o for k, c, o in zip(keep, jax.tree.leaves(chosen), jax.tree.leaves(other), strict=True)]
    return jax.tree.unflatten(jax.tree.structure(chosen), leaves)


def masked_flags(flags: Any, params: Any, fragment: Any) -> Any:
    """`flags` (one per parameter leaf, `federation.expert_flags`' tree or its leaves' structure) with None where
    `fragment` (bools like `params`, or None: all True) leaves a parameter out."""
    leaves = federation.leaf_flags(flags, params)
    keep = [True] * len(leaves) if fragment is None else jax.tree.leaves(fragment)
    return jax.tree.unflatten(jax.tree.structure(params), [f if k else None for f, k in zip(leaves, keep)])


def moment_flags(optimizer: optax.GradientTransformation, opt_state: Any, params: Any, fragment: Any = None) -> Any:
    """LocalAdamW's averaging of `optimizer`'s state: the leaves that mirror a parameter (Adam's moments, Lion's and
    Muon's momentum; which ones is what `optimizer.init` says, core.train.optimizer_state_like) are averaged like
    that parameter (True: expert, over its replica group; False: dense, over all sites); the others (step counts,
    MGUP's selected fraction, injected hyperparameters) are each site's own (None), identical across sites or a
    per-site statistic, and cost no bytes. `opt_state` and `params` may be stacked per site ([M, ...] leaves).
    `fragment` (bools like `params`): the leaves of parameters it leaves out are None too."""
    out = object()  # a parameter the fragment leaves out (None would be an empty subtree, not a leaf)
    leaves = federation.leaf_flags(masked_flags(federation.expert_flags(params), params, fragment), params)
    flags = jax.tree.unflatten(jax.tree.structure(params), [out if f is None else f for f in leaves])
    tree = train_lib.optimizer_state_like(optimizer, opt_state, params, flags, None)
    return jax.tree.map(lambda x: None if x is out else x, tree)


def site_batches(tokens: np.ndarray, sites: int) -> np.ndarray:
    """[K, M B_site, T + 1] global batches (each a pure function of its step) -> [K, M, B_site, T + 1]: site s
    takes rows s B_site .. (s + 1) B_site - 1 of every step's batch."""
    k, rows, length = tokens.shape
    if rows % sites:
        raise ValueError(f"a global batch of {rows} sequences cannot be split over {sites} sites.")
    return tokens.reshape(k, sites, rows // sites, length)
