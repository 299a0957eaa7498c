"""Multi-process runs of diffusers' context parallelism with fsattn, shared by the CPU and GPU tests.

:func:`launch` spawns one process per rank (gloo on the CPU, NCCL on GPUs), each runs one
scenario, and rank 0's result (tensors on the CPU, numbers) comes back to the test, which does the
asserting. Every scenario computes its single-process references (fsattn and SDPA) inside the
worker, from the same weights and on the same fsattn path as the parallel runs.

Nothing here imports fsattn_diffusers at module level: a spawned worker first pins
``FSATTN_CPU_PATH=emulation``, which fsattn_diffusers.ops reads once, at import.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
import warnings
from unittest import mock

import torch


def launch(scenarios: dict, world_size: int, device_type: str, out_dir) -> dict:
    """Run `scenarios` (name -> keyword options) in turn on `world_size` spawned ranks; return rank 0's
    results by name. A name is a function of SCENARIOS, or any name with the function's name as the
    option ``scenario``. One spawn for several scenarios: starting a rank (torch, diffusers) costs seconds.

    Each rank writes its standard error (Python's and the C++ libraries') to ``rank<N>.log`` in
    `out_dir`, with faulthandler's stacks if it dies by a signal (the SIGTERM that spawn sends the
    other ranks after a failure included); a failure carries those logs. Where a rank died by a
    signal of its own (not spawn's SIGTERM or SIGKILL), whichever rank spawn reported first, the
    spawn is retried once, with a warning that holds the logs: in one CI run on two cores a rank
    aborted (SIGABRT, no Python error, cause not established) in a spawn that otherwise passes
    on the same code. Anything else, or a signal twice, fails the test."""
    import torch.multiprocessing as mp

    out_dir = str(out_dir)
    spawns_own = {-signal.SIGTERM, -signal.SIGKILL}
    for attempt in (1, 2):
        init_file = os.path.join(out_dir, "rendezvous")
        if os.path.exists(init_file):
            os.remove(init_file)  # a leftover file would join this run to a finished one
        context = mp.start_processes(_worker, args=(world_size, device_type, init_file, scenarios, out_dir),
                                     nprocs=world_size, join=False, start_method="spawn")
        try:
            while not context.join():
                pass
            break
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as err:
            codes = [process.exitcode for process in context.processes]
            logs = _rank_logs(out_dir, world_size)
            signalled = any(code is not None and code < 0 and code not in spawns_own for code in codes)
            if signalled and attempt == 1:
                warnings.warn(f"{err.__class__.__name__}: {err}; exit codes {codes}; retrying the spawn once. "
                              f"The ranks' standard error:\n{logs}", stacklevel=2)
                continue
            again = " (the second spawn)" if attempt == 2 else ""
            raise RuntimeError(f"{err}{again}; exit codes {codes}; the ranks' standard error:\n{logs}") from err
    return torch.load(os.path.join(out_dir, "result.pt"), weights_only=False)


def _rank_logs(out_dir: str, world_size: int) -> str:
    parts = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.log")
        text = "(no log)"
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                text = f.read()[-4000:].strip() or "(empty)"
        parts.append(f"--- rank {rank} ---\n{text}")
    return "\n".join(parts)


def _worker(rank, world_size, device_type, init_file, scenarios, out_dir):
    import faulthandler

    import torch.distributed as dist

    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")  # noqa: SIM115 - open for the process's life
    os.dup2(log.fileno(), 2)  # the C++ side (gloo, c10) writes to file descriptor 2 before an abort
    faulthandler.enable(file=log, all_threads=True)
    # where this rank is the one spawn terminates after another's failure: where it was waiting
    faulthandler.register(signal.SIGTERM, file=log, all_threads=True, chain=True)
    if device_type == "cpu":
        os.environ["FSATTN_CPU_PATH"] = "emulation"
        torch.set_num_threads(1)  # one core per rank: CI has two
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group("gloo" if device_type == "cpu" else "nccl", init_method=f"file://{init_file}",
                            rank=rank, world_size=world_size)
    try:
        result = {}
        for name, options in scenarios.items():
            options = dict(options)
            result[name] = SCENARIOS[options.pop("scenario", name)](rank, world_size, device, **options)
        if rank == 0:
            torch.save(result, os.path.join(out_dir, "result.pt"))
        dist.barrier()
    except BaseException:
        # spawn reports the first rank to fail, often a peer that lost its connection to this one
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def cpu_counts_as_one_device():
    """Let diffusers >= 0.42 set up parallelism on a machine without an accelerator.

    diffusers 0.42's ``ModelMixin._resolve_parallel_config`` picks the rank's device as
    ``rank % torch.accelerator.device_count()``, which divides by zero where the accelerator is
    the CPU (torch counts no accelerator devices there); 0.36 used ``torch.cpu.device_count()``,
    which is 1. Each rank process has one CPU "device", so counting 1 is what the code means; the
    device mesh itself is built for "cpu" and gloo either way. Changes nothing with a GPU.
    """
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or torch._C._get_accelerator().type != "cpu" or accelerator.device_count() != 0:
        yield
        return
    with mock.patch.object(accelerator, "device_count", return_value=1):
        yield


def enable_context_parallelism(model, ulysses: int, ring: int) -> None:
    from diffusers import ContextParallelConfig

    with cpu_counts_as_one_device():
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))


def _gather_cpu(local: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate every rank's `local` along `dim` (ranks in order), on the CPU."""
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=dim).cpu()


def _stats_of_every_rank() -> list[dict]:
    import torch.distributed as dist

    import fsattn_diffusers

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, fsattn_diffusers.stats())
    return gathered


# ----------------------------------------------------------------------------- scenarios


def wan_model(rank, world_size, device, *, model, dtype, latent, text_tokens, layouts, qk_gain=1.0, route="backend"):
    """A built-in Wan transformer, single-process (SDPA, fsattn) and under context parallelism.

    Parameters
    ----------
    model : str
        A built-in name (fsattn_diffusers.builtin_models), random weights from seed 0 on every rank.
    latent : (frames, height, width) of the latent video; frames * height * width / 4 tokens.
    layouts : dict name -> (ulysses_degree, ring_degree)
    qk_gain : float
        Multiplies the q/k RMSNorm weights: scores grow by its square. Random weights give flat
        attention, under which chunks of keys have nearly equal log-sum-exps and a ring merge
        that weighted them wrongly would go unseen.
    route : str
        How fsattn is switched on: ``"backend"`` (``set_attention_backend("fsattn")``),
        ``"processor_first"`` (``set_attn_processor(FSAttnProcessor())``, then
        ``enable_parallelism``) or ``"processor_after"`` (the other order).
    """
    from fsattn_diffusers import FSAttnConfig, builtin_models, register_fsattn_backend

    # Every call on the kernel, however small (the call counts below expect it).
    register_fsattn_backend(config=FSAttnConfig(sdpa_below_flops=0, sdpa_below_keys=0))
    dtype = getattr(torch, dtype)
    spec = builtin_models.get_builtin(model)
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, spec.transformer_config["in_channels"], *latent, generator=g).to(device, dtype),
        timestep=torch.tensor([700], device=device),
        encoder_hidden_states=torch.randn(1, text_tokens, spec.transformer_config["text_dim"],
                                          generator=g).to(device, dtype),
    )

    def build():
        return builtin_models.build_transformer(model, device, dtype, seed=0)

    return _single_and_parallel_runs(build, lambda t: t.blocks, inputs, rank, device, layouts, qk_gain, route)


def ltx_model(rank, world_size, device, *, latent, text_tokens, layouts, qk_gain=1.0):
    """A tiny LTX-Video transformer (diffusers' second video DiT with a context-parallel plan, which
    splits the text across ranks too), single-process (SDPA, fsattn) and under context parallelism.

    Same contract as :func:`wan_model`; float32, one block, no text mask (a mask would make the
    ring raise: fsattn takes key-padding masks under Ulysses only).
    """
    from diffusers import LTXVideoTransformer3DModel

    from fsattn_diffusers import FSAttnConfig, register_fsattn_backend

    register_fsattn_backend(config=FSAttnConfig(sdpa_below_flops=0, sdpa_below_keys=0))
    frames, height, width = latent
    config = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=64,
                  cross_attention_dim=128, num_layers=1, caption_channels=32)
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, frames * height * width, 8, generator=g).to(device),
                  encoder_hidden_states=torch.randn(1, text_tokens, 32, generator=g).to(device),
                  timestep=torch.tensor([700], device=device), encoder_attention_mask=None,
                  num_frames=frames, height=height, width=width)

    def build():
        torch.manual_seed(0)
        return LTXVideoTransformer3DModel(**config).to(device).eval()

    return _single_and_parallel_runs(build, lambda t: t.transformer_blocks, inputs, rank, device, layouts, qk_gain)


def _single_and_parallel_runs(build, blocks_of, inputs, rank, device, layouts, qk_gain, route="backend"):
    """The model scenarios' common part: one forward of `build()`'s transformer on SDPA and on fsattn
    in one process (rank 0), then one under each context-parallel layout, with every rank's stats.
    `blocks_of(transformer)` lists the blocks whose self-attention (``attn1``) gets `qk_gain`;
    `route`: see :func:`wan_model`."""
    import fsattn_diffusers
    from fsattn_diffusers import FSAttnConfig, FSAttnProcessor

    def prepared(backend):
        transformer = build()
        with torch.no_grad():
            for block in blocks_of(transformer):
                block.attn1.norm_q.weight.mul_(qk_gain)
                block.attn1.norm_k.weight.mul_(qk_gain)
        if backend == "fsattn" and route != "backend":
            if route == "processor_first":
                transformer.set_attn_processor(FSAttnProcessor(FSAttnConfig(sdpa_below_flops=0, sdpa_below_keys=0)))
        else:
            transformer.set_attention_backend(backend)
        return transformer

    def processor_after(transformer):
        if route == "processor_after":
            transformer.set_attn_processor(FSAttnProcessor(FSAttnConfig(sdpa_below_flops=0, sdpa_below_keys=0)))

    def forward(transformer):
        with torch.no_grad():
            return transformer(**inputs, return_dict=False)[0].float().cpu()

    result = {}
    if rank == 0:  # the references need no other rank
        for backend in ("native", "fsattn"):
            transformer = prepared(backend)
            if backend == "fsattn":
                processor_after(transformer)
            result["single_" + backend] = forward(transformer)
            del transformer
    for name, (ulysses, ring) in layouts.items():
        transformer = prepared("fsattn")
        enable_context_parallelism(transformer, ulysses, ring)
        processor_after(transformer)
        if device.type == "cuda":
            forward(transformer)  # warm-up: kernel compilation
        fsattn_diffusers.reset_stats()
        result[name] = forward(transformer)
        result[name + "_stats"] = _stats_of_every_rank()
        del transformer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def ring_attention(rank, world_size, device, *, dtype, seq, heads, head_dim):
    """fsattn's backend function under ring attention (ring_degree = world size), at the attention level.

    Returns, gathered from every rank: the ring outputs of two input families (``late_sink`` under
    the frozen-max speculation, ``ramp`` under the defaults), the single-process fsattn and float64
    references, every rank's stats, and the output of a ring whose forward op hands over a log2
    LSE instead of a natural-log one (a control: the tests' bounds must catch that mistake).
    """
    import functools

    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention
    from torch.distributed.device_mesh import init_device_mesh

    import fsattn_diffusers
    from fsattn_diffusers import FSAttnConfig, diffusers_backend, fsattn, register_fsattn_backend
    from input_families import make_family
    from fsattn_diffusers.reference import attention_reference

    dtype = getattr(torch, dtype)
    parallel = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=world_size))
    mesh = init_device_mesh(device.type, (world_size, 1), mesh_dim_names=("ring", "ulysses"))
    parallel.setup(rank, world_size, device, mesh=mesh)
    local = slice(rank * seq // world_size, (rank + 1) * seq // world_size)

    def ramp_inputs():
        # Keys drift along a direction u shared by the queries: scores rise by 4 natural-log units
        # from the first key to the last, so the two halves' LSEs differ by about 2 and the ring's
        # merge weights are far from 1/2 each, yet neither half's share is negligible.
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, seq, heads, head_dim, generator=g) for _ in range(3))
        u = torch.randn(head_dim, generator=g)
        u = u / u.norm()
        q = q + head_dim**0.5 * u  # q . u ~ sqrt(D): with scale D**-0.5 the ramp adds itself to the scores
        k = k + torch.linspace(0.0, 4.0, seq)[None, :, None, None] * u
        return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)

    result = {}
    cases = {
        "late_sink": (make_family("late_sink", 1, seq, seq, heads, head_dim, dtype=dtype, device=device)[:3],
                      FSAttnConfig(max_policy="sampled")),
        "ramp": (ramp_inputs(), None),
    }
    with torch.no_grad():
        for name, ((q, k, v), config) in cases.items():
            register_fsattn_backend(config=config)
            result[name + "_single"] = fsattn(q, k, v, config=config).float().cpu()
            result[name + "_reference"] = attention_reference(q, k, v)[0].float().cpu()
            fsattn_diffusers.reset_stats()
            out = diffusers_backend._fsattn_attention(q[:, local], k[:, local], v[:, local], _parallel_config=parallel)
            result[name + "_stats"] = _stats_of_every_rank()
            result[name + "_ring"] = _gather_cpu(out.float(), dim=1)
        register_fsattn_backend()

        def log2_lse_op(*args, **kwargs):
            out = diffusers_backend._fsattn_forward_op(*args, **kwargs)
            return (out[0], out[1] * 1.4426950408889634) if isinstance(out, tuple) else out

        q, k, v = cases["ramp"][0]
        wrong = _templated_context_parallel_attention(
            q[:, local], k[:, local], v[:, local], forward_op=functools.partial(log2_lse_op),
            backward_op=diffusers_backend._fsattn_backward_op, _parallel_config=parallel)
        result["ramp_ring_log2_lse"] = _gather_cpu(wrong.float(), dim=1)
    return result


def fallbacks(rank, world_size, device):
    """Calls fsattn cannot take, under Ulysses and under a ring; the masked call fsattn can take under Ulysses.

    Returns, per case, either ``{"raised": reason}`` or the output gathered from every rank
    (``"out"``) with what it is compared with (``"expected"``), and every rank's stats.
    """
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    from torch.distributed.device_mesh import init_device_mesh

    import fsattn_diffusers
    from fsattn_diffusers import UnsupportedInputError, diffusers_backend, fsattn, register_fsattn_backend
    from fsattn_diffusers.reference import attention_reference

    def parallel_config(ulysses, ring):
        config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
        mesh = init_device_mesh(device.type, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
        config.setup(rank, world_size, device, mesh=mesh)
        return config

    ulysses, ring = parallel_config(world_size, 1), parallel_config(1, world_size)
    native = _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]
    g = torch.Generator().manual_seed(5)  # the same full sequence on every rank; each takes its share
    seq = 64
    full = {d: [torch.randn(1, seq, 2, d, generator=g).to(device) for _ in range(3)] for d in (64, 160)}
    keep = torch.ones(1, seq, dtype=torch.bool, device=device)
    keep[:, 20:] = False  # keys of both ranks' shares masked: the gathered mask must reach every rank
    keep[:, 40:44] = True
    local = slice(rank * seq // world_size, (rank + 1) * seq // world_size)

    def call(parallel, dim, strict=False, **kwargs):
        q, k, v = (t[:, local] for t in full[dim])
        register_fsattn_backend(strict=strict)
        fsattn_diffusers.reset_stats()
        try:
            out = diffusers_backend._fsattn_attention(q, k, v, _parallel_config=parallel, **kwargs)
        except UnsupportedInputError as err:
            return {"raised": err.reason, "message": str(err)}
        finally:
            register_fsattn_backend()
        return {"raised": None, "out": _gather_cpu(out, dim=1), "stats": _stats_of_every_rank()}

    result = {}
    with torch.no_grad():
        result["ulysses_key_mask"] = call(ulysses, 64, attn_mask=keep[:, local])  # 2-D (batch, keys)
        result["ulysses_key_mask"]["expected"] = fsattn(*full[64], attn_mask=keep[:, None, None, :]).cpu()
        result["ulysses_head_dim"] = call(ulysses, 160)
        q, k, v = (t[:, local] for t in full[160])
        result["ulysses_head_dim"]["expected"] = _gather_cpu(native(q, k, v, _parallel_config=ulysses), dim=1)
        result["ulysses_head_dim_strict"] = call(ulysses, 160, strict=True)
        result["ulysses_causal"] = call(ulysses, 64, is_causal=True)
        result["ring_key_mask"] = call(ring, 64, attn_mask=keep[:, local])
        result["ring_head_dim"] = call(ring, 160)
        result["ring_head_dim"]["expected"] = attention_reference(*full[160])[0].float().cpu()
    return result


def crash(rank, world_size, device, *, how, on_rank):
    """Rank `on_rank` dies (``how="abort"``: SIGABRT, as gloo's abort does; ``"raise"``: a Python
    error); the others return. For the tests of :func:`launch`'s failure reports."""
    if rank == on_rank:
        print(f"rank {rank} about to {how}", file=sys.stderr, flush=True)
        if how == "abort":
            os.abort()
        raise ValueError(f"rank {rank} raised on purpose")
    return {}


SCENARIOS = {"wan_model": wan_model, "ltx_model": ltx_model, "ring_attention": ring_attention,
             "fallbacks": fallbacks, "crash": crash}
