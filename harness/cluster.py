"""Evaluations on a Dask distributed cluster (executor.kind: dask; the optional `cluster` extra).

Each Dask worker process is one evaluation slot (harness/slot.py): it declares one unit of the
`GPU` resource and runs one task at a time, so every job's stages, microbench and replay included,
have its GPU to themselves; the process is pinned by whoever starts it (CUDA_VISIBLE_DEVICES per
`dask worker`, or the Nanny's env in the local cluster built here). The task is a module function
given pure data (job, config and target as JSON strings) that returns the `Done` as JSON; the loop's
machine keeps the only ledger. A worker lost mid-task is the scheduler's to handle: it re-runs the
task elsewhere up to `allowed_failures` (= executor.requeue_limit) times, then the job fails with
EvaluationLost. A slot that fails its health check makes its task raise `SlotUnhealthy`; that worker
is retired and the job submitted again. Each job id is answered once (harness/executors.py).
Stage progress comes back as Dask events (topic `kevo-stage`).
Not here: the scheduler itself, authentication or TLS between nodes (Dask's own; docs/CLUSTER.md).
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future

from harness.config import Config
from harness.errors import HarnessError
from harness.executors import EvaluationLost, OnStage, settle
from harness.pins import local_pins
from harness.slot import Done, Job, Slot, needs_check

try:
    import distributed
    from distributed import Client, KilledWorker, Nanny, Scheduler, SpecCluster, get_worker
except ImportError:                                    # the `cluster` extra is not installed
    distributed = None

RESOURCE = "GPU"          # what a worker declares one of: one evaluation slot (on a CPU worker too)
TOPIC = "kevo-stage"


class SlotUnhealthy(Exception):
    """Raised by a task whose worker's slot failed its health check; args: (worker address, why)."""


# -- the worker side -------------------------------------------------------------------------------

_SLOTS: dict[tuple[str, str], tuple[Slot, str]] = {}     # (config JSON, target) -> (slot, why unhealthy)
_LOCK = threading.Lock()


class CloseSlots(distributed.WorkerPlugin if distributed else object):
    """Registered on every worker: when the worker closes, its slots close their pools (zygote,
    workers, scratch folder). A worker killed outright cannot; its zygote still dies with it."""
    name = "kevo-slots"

    def teardown(self, worker) -> None:
        with _LOCK:
            for slot, _ in _SLOTS.values():
                slot.close()
            _SLOTS.clear()


def _slot(cfg_json: str, target: str) -> tuple[Slot, str]:
    """This worker process's slot, opened and health-checked on first use; one per process (a run with
    another config or target replaces it, so no two pools share the GPU)."""
    key = (cfg_json, target)
    if key not in _SLOTS:
        for old, _ in _SLOTS.values():
            old.close()
        _SLOTS.clear()
        slot = Slot(Config.model_validate_json(cfg_json), target, name=get_worker().address)
        _SLOTS[key] = (slot, slot.check())
    return _SLOTS[key]


def open_slot(cfg_json: str, target: str) -> tuple[str, str]:
    """Run once on each worker when the executor starts: (the device its slot uses, why it is
    unhealthy or ''). The device is host and GPU UUID, so two workers on one GPU are caught."""
    with _LOCK:
        slot, why = _slot(cfg_json, target)
        return ("" if why else slot.identity()), why


def evaluate_job(job_json: str, cfg_json: str, target: str) -> str:
    """Run in a Dask worker: this process's slot evaluates the job (and checks its health again after
    a crash or a hang); returns the Done as JSON."""
    worker = get_worker()
    job = Job.model_validate_json(job_json)
    with _LOCK:
        slot, why = _slot(cfg_json, target)
        if why:
            raise SlotUnhealthy(worker.address, why)
        done = slot.run(job, on_stage=lambda name: worker.log_event(TOPIC, {"id": job.id, "stage": name,
                                                                            "slot": worker.address}))
        if needs_check(done.verdict):
            _SLOTS[(cfg_json, target)] = (slot, slot.check())
    return done.model_dump_json()


# -- the loop's side -------------------------------------------------------------------------------

def local_cluster(cfg: Config):
    """A cluster on this machine: a scheduler on loopback and one worker process per slot (per GPU,
    pinned by its Nanny's CUDA_VISIBLE_DEVICES; on a CPU, executor.cpu_slots of them). One per GPU whatever
    executor.slots_per_gpu says: no lease crosses Dask workers, so two on one GPU would time each other."""
    workers = {}
    for pin in local_pins(cfg, per_gpu=1):
        env = {"CUDA_VISIBLE_DEVICES": pin.visible} if pin.device == "cuda" else {}
        workers[pin.name] = {"cls": Nanny, "options": {
            "nthreads": 1, "resources": {RESOURCE: 1}, "env": env, "host": "127.0.0.1", "dashboard": False, "silence_logs": logging.ERROR,
            "memory_limit": 0}}   # no memory watchdog: the evaluator's footprint is its pool's, not a dataframe's
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False,
                                               "allowed_failures": cfg.executor.requeue_limit}}
    return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR, name="kevo")


class DaskExecutor:
    def __init__(self, cfg: Config, target: str) -> None:
        if distributed is None:
            raise HarnessError("executor.kind is dask but dask.distributed is not installed: pip install 'kevo[cluster]'")
        self.cfg, self.target = cfg, target
        self._cfg_json = cfg.model_dump_json()
        d = cfg.executor.dask
        self.cluster = local_cluster(cfg) if d.scheduler is None else None
        try:
            self.client = Client(self.cluster or d.scheduler, timeout=d.start_timeout_s, set_as_default=False)
        except OSError as e:
            self._shut()
            raise HarnessError(f"executor.dask.scheduler {d.scheduler}: cannot connect ({e})") from None
        self.removed: dict[str, str] = {}          # worker address -> why its slot was taken out
        self._futures: dict[str, Future] = {}
        self._on_stage: dict[str, OnStage] = {}
        self._attempts: dict[str, int] = {}
        self._waiting: deque[tuple[Job, Future]] = deque()
        self._running = 0
        self._closed = False
        self._lock = threading.RLock()
        try:
            self._check_cluster(d.start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.client.subscribe_topic(TOPIC, self._stage_event)

    def _check_cluster(self, timeout: float) -> None:
        self.client.register_plugin(CloseSlots())
        allowed = self.client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.allowed_failures)
        if allowed != self.cfg.executor.requeue_limit:
            raise HarnessError(f"the Dask scheduler allows {allowed} failures per task but executor.requeue_limit is "
                               f"{self.cfg.executor.requeue_limit}: start it with "
                               f"DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES={self.cfg.executor.requeue_limit}")
        try:
            self.client.wait_for_workers(1, timeout=timeout)
        except TimeoutError:
            raise HarnessError(f"no Dask worker joined within {timeout:g} s (executor.dask.start_timeout_s)") from None
        if not self.capacity:
            raise HarnessError(f"no Dask worker declares the {RESOURCE} resource: start workers with "
                               f"--nthreads 1 --resources {RESOURCE}=1")
        workers = [a for a, w in self.client.scheduler_info()["workers"].items() if w.get("resources", {}).get(RESOURCE)]
        opened = {a: self.client.submit(open_slot, self._cfg_json, self.target, key=f"kevo-open-{a}", workers=[a],
                                        allow_other_workers=False, resources={RESOURCE: 1}, pure=False) for a in workers}
        ids = {}
        for address, fut in opened.items():
            ident, why = fut.result()
            if why:
                self.removed[address] = why
                self.client.retire_workers([address], close_workers=True, remove=True)
            else:
                ids[address] = ident
        if not ids:
            raise HarnessError("no Dask worker's slot passed its health check: " + "; ".join(self.removed.values()))
        gpus = [i for i in ids.values() if not i.split("/", 1)[1].startswith("cpu")]
        for ident in set(gpus):
            if gpus.count(ident) > 1:
                shared = [a for a, i in ids.items() if i == ident]
                raise HarnessError(f"Dask workers {', '.join(shared)} share the GPU {ident}: a microbench or replay "
                                   "would be timed beside another job; give each worker its own CUDA_VISIBLE_DEVICES")

    @property
    def capacity(self) -> int:
        workers = self.client.scheduler_info().get("workers", {}).values()
        return int(sum(w.get("resources", {}).get(RESOURCE, 0) for w in workers))

    def running(self) -> dict[str, str]:
        """Worker address -> the id of the job it is evaluating now."""
        ids = {f"kevo-{job_id}-{n}": job_id for job_id, n in self._attempts.items()}
        return {worker: ids[key] for worker, keys in self.client.processing().items() for key in keys if key in ids}

    def submit(self, job: Job, on_stage: OnStage | None = None) -> Future:
        with self._lock:
            if job.id in self._futures:
                return self._futures[job.id]
            fut: Future = Future()
            self._futures[job.id] = fut
            if on_stage is not None:
                self._on_stage[job.id] = on_stage
            self._waiting.append((job, fut))
        self._pump()
        return fut

    def _pump(self) -> None:
        """Hand Dask no more tasks than there are slots: a task Dask assigned to a busy worker would wait
        there while another GPU idles (tasks with resource restrictions are not queued on the scheduler)."""
        if self._closed:
            return
        capacity = self.capacity                 # asks the scheduler: not under the lock
        with self._lock:
            stranded = list(self._waiting) if capacity == 0 and self.removed else []   # no worker will take them
            if stranded:
                self._waiting.clear()
            free = capacity - self._running
            batch = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            batch = [(job, fut) for job, fut in batch if not fut.cancelled()]
            self._running += len(batch)
        for _, fut in stranded:
            settle(fut, error=self._none_left())
        for job, fut in batch:
            self._send(job, fut)

    def _none_left(self) -> HarnessError:
        return HarnessError("every Dask worker's slot was taken out: " + "; ".join(self.removed.values()))

    def _send(self, job: Job, fut: Future) -> None:
        with self._lock:
            attempt = self._attempts[job.id] = self._attempts.get(job.id, 0) + 1
        remote = self.client.submit(evaluate_job, job.model_dump_json(), self._cfg_json, self.target,
                                    key=f"kevo-{job.id}-{attempt}", resources={RESOURCE: 1}, pure=False)
        remote.add_done_callback(lambda r: self._answer(job, fut, r))

    def _answer(self, job: Job, fut: Future, remote) -> None:
        """Called in a thread of the client's when a task ends: settle the job's future, once."""
        if self._closed:
            return
        error = None if remote.cancelled() else remote.exception()
        if isinstance(error, SlotUnhealthy):
            address, why = error.args
            self.removed[address] = why
            self.client.retire_workers([address], close_workers=True, remove=True)
            if self.capacity:
                return self._send(job, fut)
            error = self._none_left()
        if remote.cancelled():
            fut.cancel()
        elif error is None:
            try:
                settle(fut, Done.model_validate_json(remote.result()))
            except ValueError as e:                 # pydantic's ValidationError: settled, never left pending
                settle(fut, error=EvaluationLost(f"{job.id}: the slot's answer does not validate: "
                                                 + " ".join(str(e).split())[:500]))
        elif isinstance(error, KilledWorker):
            settle(fut, error=EvaluationLost(f"{job.id}: Dask workers died under it "
                                              f"{self.cfg.executor.requeue_limit + 1} times ({error})"))
        else:
            settle(fut, error=error)
        with self._lock:
            self._running -= 1
        self._pump()

    def _stage_event(self, event) -> None:
        _, msg = event
        callback = self._on_stage.get(msg.get("id"))
        if callback is not None:
            callback(msg["stage"])

    def _shut(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    def close(self) -> None:
        self._closed = True
        for fut in self._futures.values():
            fut.cancel()
        self.client.close()
        self._shut()

    def __enter__(self) -> "DaskExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
