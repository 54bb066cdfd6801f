"""`m31r bundle ...`: make, check, convert, quantize and average model bundles (README "The default model", "Importing
Hugging Face checkpoints"), each written into its OUT folder so that a failed or stopped writer leaves nothing
behind. torch is imported inside the commands."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import click

from m31r.cli_common import bundle_summary, fail, sigterm_ends, user_errors


@contextlib.contextmanager
def _new_bundle_dir(out: Path, sources: tuple[Path, ...] = (), source_kind: str = "bundle") -> Iterator[None]:
    """Writers never mix a new bundle into an existing directory's files, into a source (`source_kind`: a bundle, or
    the checkpoint import-hf reads) or into any bundle (a bundle is exactly its five files), and leave nothing behind
    when they fail, are stopped (Ctrl-C, or SIGTERM from `timeout` or a service manager) or write a bundle that fails
    its own verification: a re-run finds OUT as it was. A writer killed outright (SIGKILL, the OOM killer, a power
    cut) leaves OUT marked unfinished (UNFINISHED_FILE, under a lock held while it writes): a re-run takes it over."""
    from m31r.checksums import UNFINISHED_FILE

    _refuse_nested_out(out, sources, source_kind)
    lock = _take_over_unfinished(out)
    created = False
    if lock is None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"{out}: already exists and is not an empty directory")
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        lock = _lock_out(out)  # (refused: another writer's, left as it is)
        if any(out.iterdir()):  # another writer filled it meanwhile
            os.close(lock)
            raise ValueError(f"{out}: already exists and is not an empty directory")
    with sigterm_ends(f"{out}: terminated (SIGTERM) before the bundle was whole; nothing was left there"):
        try:
            (out / UNFINISHED_FILE).write_text(_UNFINISHED_NOTE.format(pid=os.getpid()))
            yield
            (out / UNFINISHED_FILE).unlink()
        except BaseException as e:
            if created:
                shutil.rmtree(out, ignore_errors=True)
            elif out.is_dir():
                for child in out.iterdir():  # empty, or an unfinished bundle taken over: everything in it is ours
                    if child.is_dir():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
            _bundle_write_failed(e, out)
            if isinstance(e, KeyboardInterrupt):  # (click would say only `Aborted!`, and exit 1)
                fail(f"{out}: interrupted (Ctrl-C) before the bundle was whole; nothing was left there", 130)
            raise
        finally:
            os.close(lock)


_UNFINISHED_NOTE = ("m31r (pid {pid}) is writing a bundle into this folder. If no such process runs, it was stopped "
                    "before the end: run the same command again (it replaces this folder's content), or delete the "
                    "folder.\n")


def _refuse_nested_out(out: Path, sources: tuple[Path, ...], source_kind: str) -> None:
    """OUT inside a source, or inside any bundle folder (release/ included), would add an entry to a folder that is
    more than a directory: a bundle holds its five files only (`m31r train export` copies anything else into each
    new release), a checkpoint is uploaded or loaded as a whole."""
    from m31r.checksums import CHECKSUM_FILE

    where = out.resolve()
    for src in sources:
        if where.is_relative_to(src.resolve()):
            if source_kind == "bundle":
                raise ValueError(f"{out}: inside the source bundle {src}, which must hold its five files only: write "
                                 "the new one somewhere else")
            raise ValueError(f"{out}: inside the {source_kind} {src} it is made from, which tools load and upload as a "
                             "whole: write the bundle somewhere else")
    for folder in where.parents:
        if (folder / CHECKSUM_FILE).is_file() and (folder / "config.yaml").is_file():
            raise ValueError(f"{out}: inside the bundle {folder}, which must hold its five files only: write the new "
                             "one somewhere else")


def _lock_out(out: Path) -> int:
    """An exclusive lock on the folder OUT, held while a bundle is written into it (the kernel drops it when the
    writer ends, however it ends), so that another writer can tell a running write from one that was killed."""
    import fcntl

    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"{out}: another m31r is writing a bundle into it now: let it finish, or stop it "
                         "first") from None
    return fd


def _take_over_unfinished(out: Path) -> int | None:
    """The lock on OUT where it holds a bundle another writer left unfinished (killed outright), its content cleared
    for this one; None where it does not (another writer still running there is refused)."""
    from m31r.checksums import UNFINISHED_FILE

    marker = out / UNFINISHED_FILE
    if not out.is_dir() or not marker.is_file():
        return None
    lock = _lock_out(out)
    try:
        if not marker.is_file():  # that writer finished while this one took the lock: OUT is a whole bundle now
            os.close(lock)
            return None
        click.echo(f"note: {out} holds a bundle whose writer was stopped before the end (killed?): replacing it",
                   err=True)
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    except BaseException:
        os.close(lock)
        raise
    return lock


def _bundle_write_failed(e: BaseException, out: Path) -> None:
    """One line for what stopped a bundle writer that names no file: write() on a full disk (an OSError without a
    file name), torch's allocator (a RuntimeError)."""
    if isinstance(e, OSError) and e.filename is None and e.strerror:
        fail(f"{out}: cannot write the bundle: {e.strerror}")
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
        size = re.search(r"allocate (\d+) bytes", str(e))
        what = f"an allocation of {size[1]} bytes failed" if size else "an allocation failed"
        fail(f"{out}: not enough memory for this model ({what}): check the sizes in its config")


def _fits_in_memory(nbytes: int, what: str) -> None:
    """Refuse, before anything is built or written, a model whose float32 weights alone exceed this machine's memory:
    a config with a slip in it (`n_layers: 1000000000000`) built layer after small layer for hours, no allocation
    large enough to fail, until the machine swapped or the OOM killer ended it."""
    from m31r.bundle import physical_memory

    total = physical_memory()  # (None where the OS does not say: the allocator's own failure says it then)
    if total and nbytes > total:
        raise ValueError(f"{what}: its float32 weights take {nbytes / 2**30:,.1f} GiB, more than this machine's "
                         f"{total / 2**30:,.1f} GiB of memory: check the sizes in the config")


@click.group()
def bundle() -> None:
    """Create, import and verify model bundles."""


@bundle.command("init")
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--seed", type=click.IntRange(-(2**63), 2**64 - 1), required=True,
              help="Init seed (a 64-bit integer): the same seed gives the same weight bytes.")
@click.option("--tokenizer", "tokenizer_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="tokenizer.json to ship (default: a byte-level tokenizer padded to vocab_size).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default="bfloat16",
              show_default=True, help="Storage dtype of model.safetensors.")
@user_errors
def bundle_init(config: Path, out: Path, seed: int, tokenizer_file: Path | None, dtype: str) -> None:
    """Write a random-weight bundle for CONFIG into OUT (tests, benchmarks)."""
    import torch
    from tokenizers import Tokenizer as HFTokenizer

    from m31r.bundle import check_tokenizer, init_bundle
    from m31r.config import load_config

    cfg = load_config(config)
    _fits_in_memory(cfg.param_count() * 4, f"{config}: the model has {cfg.param_count():,} parameters")
    tok = None
    if tokenizer_file is not None:
        try:
            tok = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"{tokenizer_file}: cannot be loaded as a tokenizer: {e}") from None
        check_tokenizer(tokenizer_file, cfg, str(config))
    with _new_bundle_dir(out):
        b = init_bundle(cfg, out, seed=seed, tokenizer=tok, dtype=getattr(torch, dtype))
    click.echo(bundle_summary(b))


@bundle.command("verify")
@click.argument("path", metavar="DIR", type=click.Path(path_type=Path))
@user_errors
def bundle_verify(path: Path) -> None:
    """Check DIR end to end: checksums, config, tokenizer, tensor shapes, and that every weight is a finite number."""
    from m31r.bundle import load_weights, open_bundle

    b = open_bundle(path)
    load_weights(b)  # memory-mapped: reads the weights (the checksums just did) and refuses NaN or infinite ones
    click.echo(bundle_summary(b))


@bundle.command("import-hf")
@click.argument("hf_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dataset-version", default="unknown (imported)", show_default=True,
              help="Recorded in metadata.json for traceability.")
@user_errors
def bundle_import_hf(hf_dir: Path, out: Path, dataset_version: str) -> None:
    """Convert a Llama or Qwen2 checkpoint (safetensors) in HF_DIR into a bundle in OUT."""
    from m31r.hf_import import import_hf

    with _new_bundle_dir(out, (hf_dir,), "checkpoint"):
        b = import_hf(hf_dir, out, dataset_version=dataset_version)
    click.echo(bundle_summary(b))


@bundle.command("export-hf")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default=None,
              help="Weight dtype of the checkpoint (default: the bundle's).")
@user_errors
def bundle_export_hf(src: Path, out: Path, dtype: str | None) -> None:
    """Write the float bundle SRC as a Llama (Qwen2, with q/k/v biases) Hugging Face checkpoint in OUT."""
    from m31r.hf_export import export_hf

    with _new_bundle_dir(out, (src,)):
        export_hf(src, out, dtype=dtype)
    click.echo(f"ok {out}: config.json, model.safetensors, tokenizer.json, tokenizer_config.json")


def _average_weights(ctx: click.Context, param: click.Parameter, value: str | None) -> list[float] | None:
    """--weights as numbers, refused as a usage error before any bundle is read."""
    from m31r.bundle import WEIGHTS_RULE, usable_weights

    if value is None:
        return None
    try:
        ws = [float(w) for w in value.split(",")] if value.strip() else None
    except ValueError:
        ws = None
    if ws is None:
        raise click.BadParameter(f"{value!r} is not numbers separated by commas" if value.strip() else
                                 "empty: give one number per bundle, or leave the option out for equal weights")
    if not usable_weights(ws):
        raise click.BadParameter(f"{value!r}: {WEIGHTS_RULE}")
    return ws


def _not_empty(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """An option recorded in metadata.json that the bundle check refuses empty: refused before the writing."""
    if not value.strip():
        raise click.BadParameter("must not be empty")
    return value


@bundle.command("average")
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--weights", default=None, callback=_average_weights,
              help="Comma-separated, one per bundle (normalised to sum 1); default: equal.")
@click.option("--model-version", required=True, callback=_not_empty, help="The averaged model's version (metadata).")
@user_errors
def bundle_average(sources: tuple[Path, ...], out: Path, weights: list[float] | None, model_version: str) -> None:
    """Write the weighted average of float bundles SOURCES (one shape, one tokenizer) into OUT."""
    from m31r.bundle import average_bundles

    ctx = click.get_current_context()
    if len(sources) < 2:
        raise click.UsageError(f"average needs two or more bundles, got {len(sources)}", ctx)
    if weights is not None and len(weights) != len(sources):
        raise click.BadParameter(f"{len(weights)} weight{'s' * (len(weights) != 1)} for {len(sources)} bundles: give "
                                 "one per bundle", ctx, param_hint="'--weights'")
    with _new_bundle_dir(out, sources):
        b = average_bundles(list(sources), weights or [1.0] * len(sources), out, model_version=model_version)
    click.echo(bundle_summary(b))


@bundle.command("quantize")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--quant", type=click.Choice(["int8", "int4"]), required=True,
              help="int8: per-channel weight-only; int4: group-wise (the embedding/LM head stays int8).")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="64", show_default=True,
              help="int4 group size along the input dimension.")
@user_errors
def bundle_quantize(src: Path, out: Path, quant: str, group_size: str) -> None:
    """Write a copy of the float bundle SRC with quantized weights into OUT (serve it with `daemon --bundle OUT`)."""
    from m31r.bundle import quantize_bundle

    ctx = click.get_current_context()
    if quant != "int4" and ctx.get_parameter_source("group_size") is not click.core.ParameterSource.DEFAULT:
        raise click.BadParameter(f"applies to --quant int4 only ({quant} has one scale per output channel)", ctx,
                                 param_hint="'--group-size'")
    with _new_bundle_dir(out, (src,)):
        b = quantize_bundle(src, out, quant, int(group_size))
    click.echo(bundle_summary(b))
