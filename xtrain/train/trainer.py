"""The training loop: micro-batches -> loss -> backward -> (grad sync) -> clip -> AdamW -> metrics.

No CLI code here: the command line (progress bar, metrics JSONL, plots) lives in ``xtrain.train.cli`` and
talks to this module through ``Trainer`` and its ``on_metrics`` callback.

One optimizer step (``Trainer.train_step``), one code path on every device:
  1. fetch one batch of ``batch_size`` sequences: ``ids [B, T+1]`` (inputs ids[:, :-1], targets ids[:, 1:])
     or a pair ``(inputs [B, T], targets [B, T])`` whose targets may hold ``ignore_index`` (-100); check its
     shape, and its ids on the CPU before moving it to the model's device;
  2. write the step's lr and dropout seeds into their device buffers; then ``device_step`` (or its CUDA graph,
     ``GraphedStep``), which reads nothing back to the host:
  3. split the batch into ``grad_accum`` = k micro-batches of B/k rows and count the targets that count, N;
  4. per micro-batch j: loss_j = sum-reduced cross-entropy, its rows' place in the global batch passed to
     ``model.loss`` (the dropout masks' key); backward of loss_j / N (the seed 1/N computed in float64 and
     rounded once to the loss's dtype, so exact in fp64 too). The leaf grads accumulate to
     d(sum_j loss_j / N), which is exactly the gradient of the mean loss over the whole batch however the rows
     are split and however many targets each micro-batch ignores (a per-micro-batch mean divided by k would
     weight tokens unequally);
  5. ``all_reduce`` hook (data parallel, ``xtrain.train.distributed``): sums tensors across ranks in place;
     called on the token count before the micro-batches and on [grads..., loss sum] after them. None on one
     process;
  6. global grad norm; ok = loss and norm finite; clip to ``grad_clip``; AdamW with the scheduled lr where ok
     (where not, weights, moments and the step count stay as they were); zero grads;
  7. read (loss sum, N, ok, norm) once: a step that was not ok stops the run (``NonFiniteError`` naming the
     step), or with ``skip_nonfinite`` counts a skip; metrics.

Metrics (one dict per step, handed to ``on_metrics`` and returned): kind="train", step (1-based count of
optimizer steps done), loss (mean over counted targets), lr, grad_norm (before clipping), tokens (counted
targets this step), tokens_total, time (seconds this step), tokens_per_s, skipped, skips; with a CUDA graph
also graph ("warm-up", "replay" or "off"), graph_captures, graph_fallbacks.
Eval rows: kind="eval", step, plus whatever ``eval_fn(model)`` returns (run under eval mode and no_grad).

Atomic steps: an exception before the update (a bad batch, a failing op, a non-finite stop) restores the data
position and drops the partial gradients; Ctrl-C is deferred from the start of the step to the end of its
bookkeeping. So after any interruption the trainer is at a step boundary and ``save()`` writes a state that
resumes exactly.

Reproducibility: the only randomness in a step is dropout, whose masks are pure functions of
(seed, step, layer, site) and the element's place in the global batch (row, position, feature). A
checkpoint stores the step, the data loader's position and the optimizer moments, so training N steps
straight and k steps + resume + N-k steps give identical weights.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from xtrain import ops
from xtrain.autograd import gc_paused, no_grad
from xtrain.config import ConfigError, TrainConfig, check_compatible
from xtrain.mask import Documents
from xtrain.model import Model, mix_seed
from xtrain.train import checkpoint as ckpt_io
from xtrain.train.optim import AdamW, clip_coef, grad_norm
from xtrain.train.schedule import Schedule

IGNORE_INDEX = -100

# fields of TrainConfig that may differ on resume (they do not change the maths of the steps already taken;
# ``steps`` extends or shortens the run and so moves the cosine tail, which is the point of changing it)
RESUMABLE_CHANGES = ("steps", "ckpt_every", "eval_every", "skip_nonfinite", "max_skips", "extra")


@contextlib.contextmanager
def _deferred_sigint():
    """Hold back Ctrl-C (SIGINT) for the duration of the block, then deliver it. Used around the weight
    update so an interrupt never leaves half of the parameters stepped. Main thread only (elsewhere
    signals cannot be handled, so this is a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if pending:
            if old is signal.default_int_handler or old is None:
                raise KeyboardInterrupt
            if callable(old):
                old(signal.SIGINT, None)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step was nan or inf."""


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch source's item -> (inputs [B, T], targets [B, T])."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == 2 and x.shape == y.shape):
            raise ValueError("batch: a (inputs, targets) pair must be two tensors of the same shape [B, T]")
        return x, y
    if isinstance(batch, torch.Tensor) and batch.dim() == 2 and batch.shape[1] >= 2:
        return batch[:, :-1], batch[:, 1:]  # [B, T] each
    raise ValueError(
        f"batch: expected ids [B, T+1] or a pair (inputs [B, T], targets [B, T]), got "
        f"{type(batch).__name__} {tuple(getattr(batch, 'shape', ()))}"
    )


@no_grad()
def evaluate(
    model: Model, batches: Iterable, ignore_index: int = IGNORE_INDEX, doc_eot: int | None = None, doc_after=False
) -> dict:
    """Mean cross-entropy over every counted target of ``batches`` (eval mode, no dropout, no tape);
    ``doc_eot``: documents kept apart as in training (``TrainConfig.doc_mask``), starting at this token (or,
    with ``doc_after``, right after it: ``TrainConfig.doc_start``)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for b in batches:
            x, y = split_batch(b)
            x, y = x.to(model.device), y.to(model.device)
            mask = None if doc_eot is None else Documents.of(x, doc_eot, after=doc_after)
            total += float(model.loss(x, y, reduction="sum", ignore_index=ignore_index, mask=mask).data)
            count += int((y != ignore_index).sum())
    finally:
        model.train(was)
    loss = total / max(count, 1)
    return {"eval_loss": loss, "eval_tokens": count, "eval_ppl": math.exp(min(loss, 50.0))}


def _check_batch_values(inputs: torch.Tensor, targets: torch.Tensor, V: int, ignore_index: int, step: int) -> None:
    """Ids in [0, V) and targets in [0, V) or ignore_index; raises ValueError naming the step."""
    lo, hi = int(inputs.min()), int(inputs.max())
    if lo < 0 or hi >= V:
        raise ValueError(f"step {step}: input ids must lie in [0, {V}), got range [{lo}, {hi}]")
    t = targets[targets != ignore_index]
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= V):
        raise ValueError(
            f"step {step}: targets must lie in [0, {V}) or equal {ignore_index}, got range "
            f"[{int(t.min())}, {int(t.max())}]"
        )


def cuda_graph_capture(fn):
    """Capture ``fn()`` (one optimizer step on static buffers) as a CUDA graph; -> (replay, outputs): replay()
    re-runs the recorded work on the same buffers, outputs are the tensors fn returned (rewritten by each
    replay). Capturing records without executing, so the caller replays once for the step it captured on."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def eager_capture(fn):
    """The stand-in for ``cuda_graph_capture`` without a GPU (tests use it on the CPU): "capturing" records
    nothing and executes nothing, and each replay runs ``fn`` again on the same static buffers, writing its
    results into the one output list (so the caller sees the same protocol: replay, then read outputs)."""
    out: list = []

    def replay():
        out[:] = fn()

    return replay, out


class GraphedStep:
    """The trainer's optimizer step replayed from static input buffers.

    ``run(inputs, targets, settings)`` copies the batch into buffers that keep their addresses, warms up
    ``warmup`` eager steps on them (allocator, Triton JIT, launch plans), then captures
    ``step_fn(inputs_s, targets_s, settings)`` once with ``capture`` and from then on only replays it.
    ``settings`` is a frozen, comparable object holding every host value the step reads (``StepSettings``);
    the graph is keyed by it with the batch's shapes, dtypes and device: a change of any re-captures, saying
    so in one line. Where the graph
    cannot run (``disable``: a model off CUDA) or a capture fails, the step runs eagerly from then on, after
    one line on stderr."""

    def __init__(self, step_fn, capture=cuda_graph_capture, warmup: int = 3, say=None):
        self.step_fn, self.capture, self.warmup = step_fn, capture, warmup
        self.say = say or (lambda msg: print(f"xtrain: {msg}", file=sys.stderr))
        self.enabled = True
        self.key = None
        self.inputs = self.targets = None
        self.replay = self.out = None
        self.warm = 0
        self.captures = 0  # successful captures (a re-capture after a shape or setting change counts again)
        self.fallbacks = 0  # captures that failed (the step then runs without a graph)
        self.off_reason: str | None = None  # why the graph is off, once it is

    def disable(self, why: str) -> None:
        if self.enabled:
            self.say(f"CUDA graph off: {why}; running the step without a graph")
            self.off_reason = why
        self.enabled = False
        self.replay = self.out = self.inputs = self.targets = None

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, settings):
        if not self.enabled:
            return self.step_fn(inputs, targets, settings)
        k = (tuple(inputs.shape), inputs.dtype, tuple(targets.shape), targets.dtype, inputs.device, settings)
        if k != self.key:
            if self.key is not None:
                self.say("CUDA graph: the batch shape or a setting changed; capturing the step again")
            self.key, self.replay, self.out, self.warm = k, None, None, 0
            self.inputs, self.targets = torch.empty_like(inputs), torch.empty_like(targets)
        self.inputs.copy_(inputs)
        self.targets.copy_(targets)
        if self.replay is None:
            if self.warm < self.warmup:
                self.warm += 1
                if not self.inputs.is_cuda:
                    return self.step_fn(self.inputs, self.targets, settings)
                # warm-up on a side stream, as CUDA graph capture expects (lazy initialisations stay off the
                # capturing stream)
                main, side = torch.cuda.current_stream(), torch.cuda.Stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    out = self.step_fn(self.inputs, self.targets, settings)
                main.wait_stream(side)
                return out
            try:
                self.replay, self.out = self.capture(lambda: self.step_fn(self.inputs, self.targets, settings))
                self.captures += 1
            except Exception as e:  # a capture that fails executed nothing: run this step eagerly
                self.fallbacks += 1
                self.disable(f"capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
                return self.step_fn(inputs, targets, settings)
        self.replay()
        return self.out


@dataclass(frozen=True)
class StepSettings:
    """The host values the optimizer step reads, as one frozen tuple, and so the key of its CUDA graph (which
    holds them): any change captures again. ``Trainer.device_step`` reads the trainer's settings from here;
    AdamW reads its hyper-parameters from the optimizer, of which these fields are a copy taken each step."""

    grad_accum: int  # k micro-batches of micro_batch_size rows
    micro_batch_size: int
    grad_clip: float  # 0: no clipping
    ignore_index: int
    rank: int  # this rank's rows of the global batch: r, r + world_size, ...
    world_size: int
    betas: tuple[float, float]  # AdamW's hyper-parameters, Python floats in the update's launch
    eps: float
    weight_decays: tuple[float, ...]
    doc_eot: int | None = None  # documents start at this token (attention and positions kept apart); None: off
    doc_after: bool = False  # documents start right after doc_eot instead (TrainConfig.doc_start "after_eot")


class Trainer:
    """Trains ``model`` with ``config`` on batches from ``data``.

    data: a callable returning a batch, or an object with ``next_batch()`` (and optionally
        ``state_dict()`` / ``load_state_dict(d)``, saved in trainer_state.json for exact resume), e.g.
        ``xtrain.data.loader.TokenLoader``. Each call yields one optimizer step's batch of
        ``config.batch_size`` sequences.
    run_dir: where checkpoints go (every ``ckpt_every`` steps and at the end of ``fit``); None: none.
    eval_fn: ``eval_fn(model) -> dict`` every ``eval_every`` steps (see ``evaluate``).
    on_metrics: called with each metrics dict (train and eval rows).
    all_reduce: ``all_reduce(list[Tensor])`` summing in place across data-parallel ranks (None: one rank).
    cuda_graph: replay the step as one CUDA graph (``GraphedStep``); default: on for a CUDA model.
    graph_capture: how a step is captured (``eager_capture`` runs it again instead;
        ``xtrain.testing.replay_capture`` replays its recorded aten calls on the CPU, as a graph would).
    """

    def __init__(
        self,
        model: Model,
        config: TrainConfig,
        data,
        *,
        run_dir: str | Path | None = None,
        eval_fn: Callable[[Model], dict] | None = None,
        on_metrics: Callable[[dict], None] | None = None,
        all_reduce: Callable[[list[torch.Tensor]], None] | None = None,
        ignore_index: int = IGNORE_INDEX,
        rank: int = 0,
        world_size: int = 1,
        cuda_graph: bool | None = None,
        graph_capture=cuda_graph_capture,
    ):
        check_compatible(model.config, config)  # before any work
        if not (callable(data) or hasattr(data, "next_batch")):
            raise TypeError("Trainer: data must be a callable or have next_batch()")
        self.model = model
        self.config = config
        self.data = data
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.eval_fn = eval_fn
        self.on_metrics = on_metrics
        self.all_reduce = all_reduce
        self.ignore_index = ignore_index
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Trainer: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.rank, self.world_size = rank, world_size
        self.schedule = Schedule.from_train_config(config)
        self.optimizer = AdamW.for_model(
            model, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, weight_decay=config.weight_decay
        )
        self.graphed: GraphedStep | None = None
        if cuda_graph is None:
            cuda_graph = model.device.type == "cuda"
        if cuda_graph:
            self.graphed = GraphedStep(lambda x, y, s: self.device_step(x, y, self._lr_t, s), capture=graph_capture)
            # the data-parallel all-reduce is captured with the rest (NCCL collectives can be recorded in a
            # CUDA graph; each replay runs them on the replayed buffers)
            if graph_capture is cuda_graph_capture and model.device.type != "cuda":
                self.graphed.disable("the model is not on a CUDA device")
        # the learning rate as a device tensor: one buffer, written (never read) before each step
        self._lr_t = torch.zeros((), dtype=torch.float64, device=model.device)
        self.step = 0  # optimizer steps done (skipped steps included)
        self.skips = 0
        self.tokens_total = 0
        self.history: list[dict] = []

    # -- one step ------------------------------------------------------------------------------------
    def _next_batch(self):
        return self.data.next_batch() if hasattr(self.data, "next_batch") else self.data()

    def _data_state(self):
        return (
            self.data.state_dict()
            if hasattr(self.data, "state_dict") and hasattr(self.data, "load_state_dict")
            else None
        )

    def _fail(self, what: str) -> None:
        """Raise NonFiniteError naming the step, unless the step may be skipped."""
        msg = f"step {self.step + 1}: {what}; the weights were not updated"
        if not self.config.skip_nonfinite:
            raise NonFiniteError(msg + " (set skip_nonfinite to skip such steps instead of stopping)")
        if self.skips + 1 > self.config.max_skips:
            raise NonFiniteError(msg + f"; {self.skips + 1} non-finite steps exceed max_skips={self.config.max_skips}")

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch, checked and on the model's device: (inputs [B, T], targets [B, T])."""
        cfg, model = self.config, self.model
        inputs, targets = split_batch(self._next_batch())
        B, T = inputs.shape
        if B != cfg.batch_size:
            raise ValueError(f"step {self.step + 1}: batch has {B} sequences, config.batch_size is {cfg.batch_size}")
        if T > model.config.max_seq_len:
            raise ValueError(
                f"step {self.step + 1}: sequence length {T} exceeds max_seq_len {model.config.max_seq_len}"
            )
        if not inputs.is_cuda:  # on the CPU, before the move: inside the step the ops skip value checks
            _check_batch_values(inputs, targets, model.config.vocab_size, self.ignore_index, self.step + 1)
        return inputs.to(model.device), targets.to(model.device)

    def step_settings(self) -> StepSettings:
        cfg, opt = self.config, self.optimizer
        return StepSettings(
            grad_accum=cfg.grad_accum,
            micro_batch_size=cfg.micro_batch_size,
            grad_clip=float(cfg.grad_clip),
            ignore_index=self.ignore_index,
            rank=self.rank,
            world_size=self.world_size,
            betas=tuple(opt.betas),
            eps=opt.eps,
            weight_decays=tuple(opt.weight_decays),
            doc_eot=cfg.eot_id if cfg.doc_mask else None,
            doc_after=cfg.doc_start == "after_eot",
        )

    def accumulate(self, inputs: torch.Tensor, targets: torch.Tensor, s: StepSettings):
        """Steps 3-4 of the module docstring: the gradient of the mean loss over the (global) batch into the
        leaves' ``.grad`` (zeroed first), in ``s.grad_accum`` micro-batches; -> (loss_sum fp64, counted), device
        tensors (the token count already summed over the ranks, the loss sum this rank's)."""
        model, k, mb = self.model, s.grad_accum, s.micro_batch_size
        counted = (targets != s.ignore_index).sum()
        if self.all_reduce is not None:
            self.all_reduce([counted])
        # the backward seed 1/N, computed in float64 and rounded once, to the loss's dtype at the backward: exact
        # to the last bit in fp32 and in fp64 (a float32 seed would move every fp64 gradient by up to 3e-8)
        inv_n = 1.0 / counted.clamp(min=1).double()
        model.train()
        self.optimizer.zero_grad()
        loss_sum = torch.zeros((), dtype=torch.float64, device=inputs.device)
        with ops.value_checks_off():
            for j in range(k):
                # a token's dropout mask is keyed by its row in the global batch: this rank holds rows r, r+R, ...
                # (TokenLoader's layout), and micro-batch j the rank's rows j*mb ... (j+1)*mb - 1
                rows = (j * mb * s.world_size + s.rank, s.world_size)
                x, y = inputs[j * mb : (j + 1) * mb], targets[j * mb : (j + 1) * mb]  # [B/k, T]
                # device ops, no host read
                mask = None if s.doc_eot is None else Documents.of(x, s.doc_eot, after=s.doc_after)
                loss = model.loss(x, y, reduction="sum", ignore_index=s.ignore_index, dropout_rows=rows, mask=mask)
                loss_sum = loss_sum + loss.data.double()
                # the sum over micro-batches of loss_j / N is the whole batch's mean loss (N counted tokens)
                loss.backward(inv_n.to(loss.dtype))
        return loss_sum, counted

    def device_step(self, inputs: torch.Tensor, targets: torch.Tensor, lr: torch.Tensor, settings=None):
        """One optimizer step on batch tensors already on the model's device, reading nothing back to the host
        (so a CUDA graph can capture it): the token count, 1/N, the loss sum, the grad norm, the go-ahead ``ok``
        (loss and norm finite), the clip coefficient and the update all stay device tensors; a non-finite step is
        skipped on the device (``AdamW.step_device``: weights, moments and step count untouched). ``lr``: a 0-dim
        float64 device tensor. ``settings``: the host values it reads (default: ``step_settings()``). Value checks
        of the ops are off (the trainer checked the batch on the CPU). The step's dropout seeds are the caller's
        to write first (``model.set_dropout_step``), outside this function, so a captured graph of it reads each
        step's seeds from the model's buffer instead of holding the first step's.
        Returns device tensors (loss_sum fp64, counted, ok, norm); reading them is the caller's business.

        Rounding: on the CPU the clip scales the gradients as ``torch.nn.utils.clip_grad_norm_`` does and the
        update is torch's fused AdamW kernel, so a step is bit for bit ``clip_grad_norm_`` + ``torch.optim.AdamW(
        fused=True)`` on the same gradients. On CUDA the update is the one-launch Triton kernel with its scalars
        computed on the device in float64 and the clip folded into its gradient read."""
        s = self.step_settings() if settings is None else settings
        loss_sum, counted = self.accumulate(inputs, targets, s)
        grads = self.optimizer.grads()
        if self.all_reduce is not None:
            loss_t = loss_sum.reshape(1)
            self.all_reduce(grads + [loss_t])
            loss_sum = loss_t[0]
        norm = grad_norm(grads)
        ok = torch.isfinite(norm) & torch.isfinite(loss_sum)
        # the clip is folded into the update (on CUDA the one-launch kernel scales each gradient as it reads it)
        coef = clip_coef(s.grad_clip, norm) if s.grad_clip > 0 else None
        self.optimizer.step_device(lr, ok, coef)
        self.optimizer.zero_grad()
        return loss_sum, counted, ok, norm

    def train_step(self) -> dict:
        """One optimizer step (``device_step``, or its CUDA graph); the host reads its results once, after it.
        Atomic: an exception before the step runs (a bad batch, Ctrl-C while the batch is drawn) or from inside it
        before the update (a failing op), or a non-finite loss or norm that stops the run, leaves weights,
        moments, step and the data position as they were; Ctrl-C during the step is delivered after it and its
        bookkeeping, so a checkpoint saved after an interrupt is always a consistent state."""
        cfg, model = self.config, self.model
        t0 = time.perf_counter()
        data_before = self._data_state()
        try:
            inputs, targets = self._batch()
        except BaseException:
            if data_before is not None:
                self.data.load_state_dict(data_before)  # the batch will be drawn again
            raise
        lr = self.schedule(self.step)
        settings = self.step_settings()
        with _deferred_sigint():
            try:
                self._lr_t.fill_(lr)  # host writes into the same buffers every step, never reads
                model.set_dropout_step(mix_seed(cfg.seed, self.step))
                with gc_paused():  # the tape is acyclic: refcounting frees it; see autograd.gc_paused
                    if self.graphed is not None:
                        out = self.graphed.run(inputs, targets, settings)
                    else:
                        out = self.device_step(inputs, targets, self._lr_t, settings)
                loss_sum_t, counted_t, ok_t, norm_t = out
                # the one read of the step, after it
                loss_sum, n_tok, ok, norm = torch.stack(
                    [loss_sum_t, counted_t.double(), ok_t.double(), norm_t.double()]
                ).tolist()
                n_tok, ok = int(n_tok), ok > 0
                if not ok:
                    self._fail(
                        f"loss is {loss_sum}"
                        if not math.isfinite(loss_sum)
                        else f"gradient norm is {norm} (loss {loss_sum / max(n_tok, 1):.6g})"
                    )
            except BaseException:
                self.optimizer.zero_grad()
                if data_before is not None:
                    self.data.load_state_dict(data_before)
                raise
            self.optimizer.sync_step_count()
            self.skips += not ok
            self.step += 1
            self.tokens_total += n_tok
            dt = time.perf_counter() - t0
            m = {
                "kind": "train",
                "step": self.step,
                "loss": loss_sum / max(n_tok, 1) if ok else float("nan"),
                "lr": lr,
                "grad_norm": norm,
                "tokens": n_tok,
                "tokens_total": self.tokens_total,
                "time": dt,
                "tokens_per_s": n_tok / dt if dt > 0 else float("inf"),
                "skipped": not ok,
                "skips": self.skips,
            }
            if self.graphed is not None:  # whether the step ran as a graph: a fallback is never silent
                g = self.graphed
                m["graph"] = "off" if not g.enabled else ("replay" if g.replay is not None else "warm-up")
                m["graph_captures"], m["graph_fallbacks"] = g.captures, g.fallbacks
            self._emit(m)  # the row of a step that counted is written before a deferred Ctrl-C lands
        return m

    def _emit(self, m: dict) -> None:
        self.history.append(m)
        if self.on_metrics is not None:
            self.on_metrics(m)

    # -- the loop --------------------------------------------------------------------------------------
    def run_eval(self) -> dict | None:
        if self.eval_fn is None:
            return None
        was = self.model.training
        self.model.eval()
        try:
            with no_grad():
                res = dict(self.eval_fn(self.model))
        finally:
            self.model.train(was)
        m = {"kind": "eval", "step": self.step, **res}
        self._emit(m)
        return m

    def fit(self, steps: int | None = None, should_stop: Callable[[], bool] | None = None) -> list[dict]:
        """Run until ``config.steps`` optimizer steps are done (or ``steps`` more, or ``should_stop()``, asked
        before each step, says so); checkpoint and eval on their schedules and save at the end (when there is
        a run directory). Returns this call's metrics."""
        cfg = self.config
        end = cfg.steps if steps is None else min(cfg.steps, self.step + int(steps))
        start = len(self.history)
        while self.step < end:
            if should_stop is not None and should_stop():
                break
            self.train_step()
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                self.run_eval()
            if self.run_dir is not None and cfg.ckpt_every and self.step % cfg.ckpt_every == 0:
                self.save()
        if self.run_dir is not None and (not cfg.ckpt_every or self.step % cfg.ckpt_every != 0):
            self.save()
        return self.history[start:]

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        data_state = self.data.state_dict() if hasattr(self.data, "state_dict") else None
        return {
            "step": self.step,
            "skips": self.skips,
            "tokens_total": self.tokens_total,
            "seeds": {"run": self.config.seed, "dropout": "mix_seed(run, step), keyed by global row"},
            "schedule": self.schedule.to_dict(),
            "data": data_state,
            "optimizer_step": self.optimizer.step_count,
        }

    def save(self, run_dir: str | Path | None = None) -> Path:
        run_dir = Path(run_dir) if run_dir is not None else self.run_dir
        if run_dir is None:
            raise ValueError("Trainer.save: no run directory")
        return ckpt_io.save_checkpoint(
            run_dir,
            model=self.model,
            optimizer=self.optimizer,
            trainer_state=self.state_dict(),
            train_config=self.config,
        )

    def resume(self, run_dir: str | Path | None = None) -> int:
        """Load a checkpoint written by ``save`` into this trainer (model, optimizer, step, data position).
        Everything is read and checked first; a bad or mismatched file raises CheckpointError naming it and
        nothing is changed. Returns the step to continue from."""
        run_dir = Path(run_dir) if run_dir is not None else self.run_dir
        if run_dir is None:
            raise ValueError("Trainer.resume: no run directory")
        ck = ckpt_io.read_checkpoint(run_dir)
        if ck.train_config is not None:
            diff = [
                k
                for k, v in ck.train_config.to_dict().items()
                if k not in RESUMABLE_CHANGES and getattr(self.config, k) != v
            ]
            # another world size may split the same global batch differently (the data order and dropout keys
            # depend on the global batch only)
            was = ck.train_config.extra.get("world_size")
            same_global = was and ck.train_config.batch_size * was == self.config.batch_size * self.world_size
            if diff == ["batch_size"] and same_global:
                diff = []
            if diff:
                raise ckpt_io.CheckpointError(
                    f"{run_dir / ckpt_io.CONFIG}: train config differs from this run in {diff}; resuming would "
                    f"not continue the same run (only {list(RESUMABLE_CHANGES)} may change)"
                )
        st = ck.trainer_state
        data_state = st.get("data")
        if data_state is not None and not hasattr(self.data, "load_state_dict"):
            raise ckpt_io.CheckpointError(
                f"{run_dir / ckpt_io.STATE}: holds a data-loader position but this "
                "trainer's data source has no load_state_dict()"
            )
        if st.get("optimizer_step", ck.optim_meta.get("step")) != ck.optim_meta.get("step"):
            raise ckpt_io.CheckpointError(
                f"{run_dir / ckpt_io.OPTIMIZER}: optimizer step "
                f"{ck.optim_meta.get('step')} != {st.get('optimizer_step')} in "
                f"{ckpt_io.STATE}"
            )
        # data position first (the loader checks it fits its shards); then model + optimizer, which
        # restore() checks completely before copying; on failure the loader is put back
        old_data = self.data.state_dict() if data_state is not None else None
        if data_state is not None:
            try:
                self.data.load_state_dict(data_state)
            except (ValueError, KeyError, TypeError) as e:
                raise ckpt_io.CheckpointError(
                    f"{run_dir / ckpt_io.STATE}: data-loader position does not fit this data source: {e}"
                ) from None
        try:
            ckpt_io.restore(ck, self.model, self.optimizer)
        except Exception:
            if old_data is not None:
                self.data.load_state_dict(old_data)
            raise
        self.step = ck.step
        self.skips = int(st.get("skips", 0))
        self.tokens_total = int(st.get("tokens_total", 0))
        return self.step


def build_trainer(
    run_dir: str | Path, data, *, device: str | torch.device = "cpu", train_config: TrainConfig | None = None, **kwargs
) -> Trainer:
    """A Trainer for an existing run directory: the model is rebuilt from its config.json and everything
    is resumed. ``train_config`` (optional) replaces the stored one (subject to RESUMABLE_CHANGES)."""
    model_cfg, stored = ckpt_io.read_config(run_dir)
    cfg = train_config or stored
    if cfg is None:
        raise ConfigError(f"{Path(run_dir) / ckpt_io.CONFIG}: holds no train config; pass train_config")
    trainer = Trainer(Model(model_cfg, device=device), cfg, data, run_dir=run_dir, **kwargs)
    trainer.resume(run_dir)
    return trainer
