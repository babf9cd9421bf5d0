"""The Ray trainer backend (``trainer.backend: ray``): the torch backend with its policy update run data-parallel.

The learner process keeps everything :mod:`reef_core.grow.torch_backend` does: the policy, the objective's
preparation (advantages, critic steps, the reference model's scores), the gate's snapshot, export, checkpoints and
evaluation. Only the policy update (the objective's loss, backward, clipping, the AdamW step) runs on
``num_workers`` Ray actors, each holding a replica of the policy and its own optimizer:

1. the learner prepares the batch (``objective.prepare``) and puts it in Ray's object store once;
2. worker ``rank`` takes its contiguous share of the rows (``batch.split(num_workers)[rank]``, which keeps the whole
   batch's normalisers) and runs the loss over it in micro-batches, then backward;
3. the gradients are summed across workers with ``torch.distributed`` (gloo on CPU, NCCL on GPUs). The shares'
   losses add up to the batch loss (the scaling rule of :mod:`reef_core.grow.objective`), so the sum is the
   single-process gradient of the batch;
4. every worker clips and steps its optimizer on that same gradient, so the replicas stay equal. Worker 0 sends
   the trained tensors back, the learner copies them into its policy and builds the candidate exactly as the
   torch backend does (payload, files, metrics, algorithm state).

So releases and checkpoints are the torch backend's, and a scenario can switch between the two backends across
a restart. When the learner's weights change any other way (a rejected candidate restores the snapshot, a restart
or rollback loads a release), the workers get those weights and fresh optimizer moments before the next step, as
the torch backend restarts its own. A step that fails on the workers (a dead actor, a timeout) stops them: the
learner retries the batch later and the next step starts new workers from the learner's weights, with fresh
optimizer moments.

Workers run only :meth:`~reef_core.grow.objective.Objective.loss`, after the base ``Objective.setup`` (device and
micro-batches): ``prepare`` stays in the learner with the reference model and any auxiliary model, and each step
sends the workers the prepared batch, ``prepared.data`` and the objective's ``json_state``. An objective whose loss
reads state built by its own ``setup`` does not fit this backend.

Cluster (``trainer.options.ray``, see :class:`RayOptions`): ``address`` joins a running cluster; without it (and
without Ray already initialised in the process) a local one is started with ``num_cpus`` CPUs and shut down when its
last trainer closes. Workers import reef-core and the recipe's package: install them on every node (or give a
``runtime_env``). Ray is imported only here, when a trainer of this backend first steps.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Mapping

import torch
from torch import Tensor

from reef_core.errors import ConfigError
from reef_core.grow.objective import Objective, Prepared
from reef_core.grow.optim import adamw

log = logging.getLogger("reef.grow.ray")

#: Gradients are all-reduced in flat buckets of at most this many bytes (one collective each).
BUCKET_BYTES = 32 << 20


class RayBackendError(RuntimeError):
    """The Ray workers could not start or did not finish a step (the learner retries the batch later)."""


@dataclass(frozen=True)
class RayOptions:
    """``trainer.options.ray``: where and how the data-parallel workers run."""

    #: Data-parallel workers (one policy replica each).
    num_workers: int = 2
    #: A running cluster to join (``auto``, ``host:port`` or ``ray://host:10001``); unset: start a local one.
    address: str | None = None
    #: CPUs of a started local cluster; unset: what the workers ask (``num_workers * cpus_per_worker``).
    num_cpus: int | None = None
    #: Resources each worker reserves. With GPUs the workers train on CUDA and all-reduce with NCCL.
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    #: Ray ``runtime_env`` of the workers (e.g. ``{"pip": [...]}``, ``{"env_vars": {...}}``) on a shared cluster.
    runtime_env: dict | None = None
    #: Deadline for placing the workers and joining their process group, and for every step and collective.
    timeout_s: float = 600.0

    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    @classmethod
    def from_config(cls, options: Mapping[str, Any] | None, *, who: str = "trainer") -> "RayOptions":
        """Validate ``trainer.options`` (its ``ray`` entry; other backends' entries are left alone)."""
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"{who}: trainer.options must be a mapping")
        raw = (options or {}).get("ray")
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{who}: trainer.options.ray must be a mapping")
        raw = {str(k).replace("-", "_"): v for k, v in raw.items()}
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"{who}: trainer.options.ray has no key(s) {', '.join(unknown)} "
                              f"(known: {', '.join(known)})")

        def number(key: str, *, integer: bool = False, minimum: float = 0.0, strict: bool = True,
                    optional: bool = False):
            value = raw.get(key)
            if value is None and optional:
                return None
            ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
            if not ok or not math.isfinite(value) or (value <= minimum if strict else value < minimum):
                kind = "an integer" if integer else "a number"
                raise ConfigError(f"{who}: trainer.options.ray.{key} must be {kind} "
                                  f"{'>' if strict else '>='} {minimum:g}, got {value!r}")
            return int(value) if integer else float(value)

        settings: dict[str, Any] = {}
        if "num_workers" in raw:
            settings["num_workers"] = number("num_workers", integer=True)
        if "num_cpus" in raw:
            settings["num_cpus"] = number("num_cpus", integer=True, optional=True)
        if "cpus_per_worker" in raw:
            settings["cpus_per_worker"] = number("cpus_per_worker")
        if "gpus_per_worker" in raw:
            settings["gpus_per_worker"] = number("gpus_per_worker", strict=False)
        if "timeout_s" in raw:
            settings["timeout_s"] = number("timeout_s")
        if raw.get("address") is not None:
            if not isinstance(raw["address"], str) or not raw["address"].strip():
                raise ConfigError(f"{who}: trainer.options.ray.address must be a non-empty string")
            settings["address"] = raw["address"].strip()
        if raw.get("runtime_env") is not None:
            if not isinstance(raw["runtime_env"], Mapping):
                raise ConfigError(f"{who}: trainer.options.ray.runtime_env must be a mapping")
            settings["runtime_env"] = _plain(raw["runtime_env"])
        return cls(**settings)


def _plain(value: Any) -> Any:
    """Config containers (OmegaConf) as plain dicts and lists, for Ray to serialise."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _moved(value: Any, device: str | torch.device) -> Any:
    """``value`` (a Prepared, a TokenBatch, containers of tensors) with every tensor on ``device``."""
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, Prepared):
        return replace(value, batch=value.batch.to(device), data=_moved(value.data, device), metrics={})
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, device) for v in value)
    if hasattr(value, "to") and hasattr(value, "input_ids"):  # a TokenBatch
        return value.to(device)
    return value


def all_reduce_sum(tensors: list[Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum ``tensors`` in place across the process group, a few flat buckets (one dtype each) at a time."""
    import torch.distributed as dist

    bucket: list[Tensor] = []
    size = 0

    def flush() -> None:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (t.dtype != bucket[0].dtype or size + nbytes > bucket_bytes):
            flush()
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        flush()


class RayWorker:
    """One data-parallel rank (a Ray actor): a policy replica, its AdamW and a share of every batch."""

    def __init__(self, rank: int, world: int, threads: int = 1):
        self.rank, self.world = rank, world
        torch.set_num_threads(max(1, threads))  # its CPU share: more threads than cores only wait on each other

    def rendezvous(self) -> str:
        """``tcp://<this node>:<free port>``: where the process group meets (asked of rank 0)."""
        import socket

        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join(self, init_method: str, backend: str, device: str, timeout_s: float) -> None:
        import torch.distributed as dist

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RayBackendError("a Ray worker was given a GPU but torch sees no CUDA device")
        self.device = torch.device(device)
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))

    def setup(self, policy: torch.nn.Module, objective: Objective, names: list[str], opt_args: dict,
              max_grad_norm: float | None, micro_batches: int) -> None:
        self.policy = policy.to(self.device)
        self.policy.eval()  # as the learner's policy: no dropout in the importance ratio
        named = {n: p for n, p in self.policy.named_parameters() if p.requires_grad}
        if list(named) != list(names):
            raise RayBackendError("the worker's policy replica does not have the learner's trainable parameters")
        self.params = [named[n] for n in names]
        Objective.setup(objective, self.policy, None, self.device, micro_batches=micro_batches)
        self.objective = objective
        self.opt_args = dict(opt_args)
        self.optimizer = adamw(self.params, **self.opt_args)
        self.max_grad_norm = max_grad_norm
        self.micro_batches = max(1, int(micro_batches))

    def load(self, tensors: list[Tensor]) -> None:
        """The learner's weights (in parameter order), with fresh optimizer moments."""
        with torch.no_grad():
            for p, t in zip(self.params, tensors):
                p.copy_(t.to(p.device))
        self.optimizer = adamw(self.params, **self.opt_args)

    def step(self, prepared: Prepared, objective_state: Any, apply: bool = True, want_grads: bool = False) -> dict:
        """Loss and backward over this rank's share, gradients summed across ranks, clip, optimizer step (``apply``
        and a finite norm). Rank 0 returns the trained tensors (and, with ``want_grads``, the summed gradients
        before clipping)."""
        self.objective.load_json_state(objective_state)
        prepared = _moved(prepared, self.device)
        shares = prepared.batch.split(self.world)
        for p in self.params:
            p.grad = None
        total, sums = 0.0, {}
        if self.rank < len(shares):  # a batch smaller than the world leaves some ranks without rows
            for micro in shares[self.rank].split(self.micro_batches):
                loss, parts = self.objective.loss(self.policy, micro, prepared)
                loss.backward()
                total += float(loss.detach())
                for key, value in parts.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_sum([p.grad for p in self.params])
        out: dict[str, Any] = {"loss": total, "sums": sums}
        if want_grads and self.rank == 0:
            out["grads"] = [p.grad.detach().to("cpu", copy=True) for p in self.params]
        norm = float(torch.nn.utils.clip_grad_norm_(
            self.params, self.max_grad_norm if self.max_grad_norm is not None else float("inf")))
        out["grad_norm"] = norm
        if apply and math.isfinite(norm):
            self.optimizer.step()
            if self.rank == 0:
                out["params"] = [p.detach().to("cpu", copy=True) for p in self.params]
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# -- the cluster: joined or started once per process, shared by its trainers --------------------------------------

_cluster_lock = threading.Lock()
_cluster_users = 0
_cluster_owned = False


def _acquire_cluster(opts: RayOptions) -> None:
    global _cluster_users, _cluster_owned
    import ray

    with _cluster_lock:
        if not ray.is_initialized():
            if opts.address:
                ray.init(address=opts.address, include_dashboard=False)
            else:
                cpus = opts.num_cpus or max(1, math.ceil(opts.num_workers * opts.cpus_per_worker))
                ray.init(num_cpus=cpus, include_dashboard=False)
            _cluster_owned = True
            log.info("ray: %s", f"joined {opts.address}" if opts.address else "started a local cluster")
        _cluster_users += 1


def _release_cluster() -> None:
    global _cluster_users, _cluster_owned
    import ray

    with _cluster_lock:
        _cluster_users = max(0, _cluster_users - 1)
        if _cluster_users == 0 and _cluster_owned:
            ray.shutdown()  # started (or joined) for these trainers: its local processes end with it
            _cluster_owned = False


# -- the trainer -------------------------------------------------------------------------------------------------


class RayDataParallel:
    """Mixin over a :class:`~reef_core.grow.torch_backend.TorchTrainer` class (see :func:`with_ray`): its policy
    update runs on Ray workers (see the module docstring); the rest of the trainer is unchanged."""

    def __init__(self, objective: Objective, load_base_model, options=None, *, ray: RayOptions | None = None,
                 **settings):
        self.ray_options = ray if ray is not None else RayOptions()
        # The workers' copy of the objective, taken before the learner's setup builds its auxiliary models.
        self._worker_objective = copy.deepcopy(objective)
        self._workers: list | None = None
        self._replicas_stale = False
        self._ray_lock = threading.Lock()
        super().__init__(objective, load_base_model, options, **settings)

    # -- workers -----------------------------------------------------------------------------------------------

    def _start_workers(self) -> list:
        import ray

        opts = self.ray_options
        _acquire_cluster(opts)
        actor = ray.remote(RayWorker).options(num_cpus=opts.cpus_per_worker, num_gpus=opts.gpus_per_worker,
                                              max_restarts=0, **({"runtime_env": opts.runtime_env}
                                                                 if opts.runtime_env else {}))
        threads = max(1, int(opts.cpus_per_worker))
        workers = [actor.remote(rank, opts.num_workers, threads) for rank in range(opts.num_workers)]
        device, backend = ("cuda", "nccl") if opts.use_gpu else ("cpu", "gloo")
        try:
            init_method = ray.get(workers[0].rendezvous.remote(), timeout=opts.timeout_s)
            ray.get([w.join.remote(init_method, backend, device, opts.timeout_s) for w in workers],
                    timeout=opts.timeout_s)
            policy = self._policy if self.device.type == "cpu" else copy.deepcopy(self._policy).to("cpu")
            policy_ref, objective_ref = ray.put(policy), ray.put(self._worker_objective)
            micro = max(1, math.ceil(self.grad_accumulation / opts.num_workers))
            ray.get([w.setup.remote(policy_ref, objective_ref, self._param_names, self._opt_args,
                                    self.max_grad_norm, micro) for w in workers], timeout=opts.timeout_s)
        except Exception as exc:
            self._kill(workers)
            _release_cluster()
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise RayBackendError(
                    f"{opts.num_workers} Ray workers ({opts.cpus_per_worker:g} CPU, {opts.gpus_per_worker:g} GPU "
                    f"each) were not ready within {opts.timeout_s:g}s: does the cluster have room for them?") from exc
            raise RayBackendError(f"the Ray workers failed to start: {exc}") from exc
        log.info("ray: %d workers ready (%s)", opts.num_workers, backend)
        self._replicas_stale = False
        return workers

    @staticmethod
    def _kill(workers: list) -> None:
        import ray

        for w in workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _stop_workers(self) -> None:
        workers, self._workers = self._workers, None
        if workers is None:
            return
        import ray

        try:  # a polite exit from the process group first; killing ends the actors either way
            ray.get([w.leave.remote() for w in workers], timeout=10)
        except Exception:  # noqa: BLE001
            pass
        self._kill(workers)
        _release_cluster()

    def _run_workers(self, prepared: Prepared, *, apply: bool, want_grads: bool = False) -> list[dict]:
        import ray

        with self._ray_lock:
            if self._workers is None:
                self._workers = self._start_workers()
            workers = self._workers
            try:
                if self._replicas_stale:
                    tensors = ray.put([p.detach().to("cpu") for p in self._params])
                    ray.get([w.load.remote(tensors) for w in workers], timeout=self.ray_options.timeout_s)
                    self._replicas_stale = False
                shipped = ray.put(_moved(prepared, "cpu"))
                state = self.objective.json_state()
                return ray.get([w.step.remote(shipped, state, apply, want_grads) for w in workers],
                               timeout=self.ray_options.timeout_s)
            except Exception as exc:
                # Replicas may now differ (some stepped, some not): start afresh from the learner's weights.
                self._stop_workers()
                raise RayBackendError(f"the Ray workers failed a step: {exc}") from exc

    # -- the TorchTrainer hooks --------------------------------------------------------------------------------

    def _apply_gradients(self, prepared: Prepared) -> tuple[float, dict[str, float], float]:
        results = self._run_workers(prepared, apply=True)
        total = sum(r["loss"] for r in results)
        sums: dict[str, float] = {}
        for r in results:
            for key, value in r["sums"].items():
                sums[key] = sums.get(key, 0.0) + value
        grad_norm = results[0]["grad_norm"]
        if math.isfinite(grad_norm):
            with torch.no_grad():
                for p, t in zip(self._params, results[0]["params"]):
                    p.copy_(t.to(p.device))
        return total, sums, grad_norm

    def _restore_snapshot(self, snap: dict) -> None:
        super()._restore_snapshot(snap)
        self._replicas_stale = True

    def _load_release(self, release_id: str, files: Mapping[str, Any]) -> None:
        super()._load_release(release_id, files)
        self._replicas_stale = True

    def train(self, batch, ctx):
        update = super().train(batch, ctx)
        if update is not None:
            update.metrics["ray/workers"] = self.ray_options.num_workers
        return update

    def gradients(self, tb) -> dict[str, Tensor]:
        """The workers' summed gradient of one batch (before clipping), by parameter name; nothing is stepped."""
        self.load()
        prepared = self.objective.prepare(self._policy, tb.to(self.device))
        grads = self._run_workers(prepared, apply=False, want_grads=True)[0]["grads"]
        return dict(zip(self._param_names, grads))

    def close(self) -> None:
        with self._ray_lock:
            self._stop_workers()
        super().close()


_CLASSES: dict[type, type] = {}


def with_ray(cls: type) -> type:
    """``cls`` (a TorchTrainer class, a recipe's subclass included) with the Ray policy update."""
    if issubclass(cls, RayDataParallel):
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(f"Ray{cls.__name__}", (RayDataParallel, cls),
                                    {"__module__": __name__, "__doc__": cls.__doc__})
    return made
