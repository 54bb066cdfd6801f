"""`m31r train ...`: corpus, tokenizer, model, release bundle (README "The default model"). torch and the trainer are
imported inside the commands."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click

from m31r.cli_common import a_number, bundle_summary, check_device, fail, finite, sigterm_ends, user_errors

DEFAULT_SOURCE_ROOTS = ("/usr/lib/rustlib/src/rust", "/usr/share/cargo/registry")


@click.group()
def train() -> None:
    """Build the corpus and tokenizer, train the model, export a release bundle."""


DEFAULT_DEBIAN_CACHE = Path.home() / ".cache" / "m31r" / "debian"


@train.command("fetch")
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_DEBIAN_CACHE,
              show_default=True, help="Where the .deb files and their unpacked sources go.")
@click.option("--later/--no-later", default=True, show_default=True,
              help="Also fetch the later Debian suite's crates (trixie), into CACHE/trixie.")
@user_errors
def train_fetch(cache: Path, later: bool) -> None:
    """Download rust-src and every librust-*-dev package of Debian 12 (and 13) and unpack them; nothing is
    installed, and the host's apt sources are not used."""

    from m31r.train import debian

    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        fail("apt-get and dpkg are needed: the corpus comes from Debian's packages")
    for suite in (debian.BASE_SUITE, *(debian.LATER_SUITES if later else ())):
        try:
            roots, packages = debian.fetch_suite(cache, suite)
        except RuntimeError as e:
            fail(str(e))
        folder = debian.suite_folder(cache, suite)
        click.echo(f"{suite}: {len(packages)} packages in {folder}; source roots: {' '.join(map(str, roots))}")


@train.command("corpus")
@click.argument("data_dir", type=click.Path(path_type=Path))
@click.option("--debian", "cache", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A cache made by `m31r train fetch`: its sources and package versions.")
@click.option("--source", "sources", multiple=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Rust source root (repeatable; default: Debian's rust-src and crate sources, where installed).")
@click.option("--val-fraction", type=click.FloatRange(0, 1, max_open=True), default=0.03, show_default=True,
              callback=finite,
              help="Share of crates held out for validation and the eval.")
@click.option("--later/--no-later", default=True, show_default=True,
              help="Add the later suite's files (fetched into the --debian cache) to training; held-out crates stay.")
@user_errors
def train_corpus(data_dir: Path, cache: Path | None, sources: tuple[Path, ...], val_fraction: float,
                 later: bool) -> None:
    """Filter, deduplicate and split Rust sources by crate into DATA_DIR/corpus."""
    from m31r.train import debian
    from m31r.train.corpus import build_corpus

    packages = None
    roots = list(sources)
    train_only: list[tuple[str, Path]] = []
    if cache is not None:
        if not (cache / "packages.tsv").exists():
            fail(f"{cache} has no packages.tsv: run `m31r train fetch --cache {cache}` first")
        packages = debian.read_packages(cache / "packages.tsv")
        roots += debian.source_roots(cache)
        for suite in debian.LATER_SUITES if later else ():
            if (cache / suite / "packages.tsv").exists():
                packages |= {f"{suite}:{k}": v for k, v in debian.read_packages(cache / suite / "packages.tsv").items()}
                train_only += [(suite, root) for root in debian.source_roots(cache / suite)]
    roots = roots or [Path(p) for p in DEFAULT_SOURCE_ROOTS if Path(p).is_dir()]
    if not roots:
        fail("no Rust sources found: run `m31r train fetch` and pass --debian, or pass --source")
    manifest = build_corpus(roots, data_dir / "corpus", val_fraction=val_fraction, packages=packages,
                            train_only_roots=train_only)
    tr, va = manifest["splits"]["train"], manifest["splits"]["val"]
    click.echo(f"dataset {manifest['dataset_version']} written to {data_dir / 'corpus'}")
    click.echo(f"kept {manifest['files_kept']:,} of {manifest['files_seen']:,} files; dropped {manifest['dropped']}")
    click.echo(f"train: {tr['files']:,} files, {tr['bytes'] / 1e6:.1f} MB, {tr['crates']:,} crates; "
               f"val: {va['files']:,} files, {va['bytes'] / 1e6:.1f} MB, {va['crates']:,} held-out crates")


@train.command("tokenizer")
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--vocab-size", type=click.IntRange(5 + 256, 1 << 20), default=16384, show_default=True,
              help="Tokens in all: at least the 5 special tokens and 256 byte symbols every m31r tokenizer has.")
@click.option("--reuse", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Take this tokenizer.json instead of training one (a model to continue needs its own).")
@user_errors
def train_tokenizer_cmd(data_dir: Path, vocab_size: int, reuse: Path | None) -> None:
    """Train the byte-level Rust BPE on DATA_DIR/corpus/train.jsonl (or reuse one), then tokenise both splits."""

    from m31r.train.corpus import unfinished_build
    from m31r.train.tokenizer import bytes_per_token, train_tokenizer
    from m31r.train.trainer import corpus_tokens

    if (unfinished := unfinished_build(data_dir / "corpus")) is not None:
        fail(unfinished)
    out = data_dir / "tokenizer.json"
    if reuse is not None:
        if reuse.resolve() != out.resolve():
            shutil.copyfile(reuse, out)
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(out))
        click.echo(f"tokenizer: {reuse} ({tok.get_vocab_size()} tokens)")
    else:
        tok = train_tokenizer(data_dir / "corpus" / "train.jsonl", out, vocab_size)
        click.echo(f"tokenizer: {vocab_size} tokens")
    bpt = bytes_per_token(tok, data_dir / "corpus" / "val.jsonl")
    click.echo(f"{bpt:.3f} bytes/token on the validation split")
    for split, n in corpus_tokens(data_dir).items():
        click.echo(f"{split}: {n:,} tokens")


@train.command("textbook")
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The new data folder (corpus/, tokenizer.json), to pass to `m31r train model --data`.")
@click.option("--plain-share", type=click.FloatRange(min=0), default=1.0, show_default=True, callback=finite,
              help="Whole train files to add, in characters, per character of textbook pieces.")
@click.option("--seed", type=int, default=0, show_default=True)
@user_errors
def train_textbook(data_dir: Path, out_dir: Path, plain_share: float, seed: int) -> None:
    """Cut DATA_DIR's train split into doc-test examples and small documented functions, one file each, mixed
    with whole train files, as a data folder of their own (same validation split and tokenizer)."""
    from m31r.train.corpus import unfinished_build
    from m31r.train.textbook import build_textbook

    if (unfinished := unfinished_build(data_dir / "corpus")) is not None:
        fail(unfinished)
    for need in (data_dir / "corpus" / "train.jsonl", data_dir / "corpus" / "manifest.json",
                 data_dir / "tokenizer.json"):
        if not need.exists():
            fail(f"{need} is missing: build DATA_DIR with `m31r train corpus` and `m31r train tokenizer` first")
    if out_dir.resolve() == data_dir.resolve():
        fail("--out must be a folder other than DATA_DIR")
    tb = build_textbook(data_dir, out_dir, plain_share=plain_share, seed=seed)["textbook"]
    click.echo(f"{tb['examples']:,} doc examples and {tb['functions']:,} documented functions "
               f"({tb['piece_chars'] / 1e6:.1f} MB), {tb['plain_files']:,} whole files "
               f"({tb['plain_chars'] / 1e6:.1f} MB) in {out_dir / 'corpus'}")


@train.command("model")
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--data", "data_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--run", "run_dir", type=click.Path(path_type=Path), required=True,
              help="Checkpoints and logs; an existing run is resumed.")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), default=None, callback=a_number,
              help="Stop (with a checkpoint) after this long.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Stop (with a checkpoint) at this step; the learning-rate and context schedules still follow the "
                   "config's max_steps, so a later run resumes seamlessly.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Start a new run from this float bundle's weights (fresh optimizer); ignored when resuming.")
@user_errors
def train_model(config: Path, data_dir: Path, run_dir: Path, max_minutes: float | None, max_steps: int | None,
                device: str, init_from: Path | None) -> None:
    """Train (or resume) the model described by a training CONFIG (configs/train/*.yaml). Ctrl-C or SIGTERM saves
    a checkpoint first; running the same command again resumes from it."""
    try:
        check_device(device)
        from m31r.train.trainer import TrainingStopped
        from m31r.train.trainer import train as run_training

        try:
            state = run_training(config, data_dir, run_dir, max_minutes=max_minutes, max_steps=max_steps,
                                 device=device, init_from=init_from, log=lambda s: click.echo(s, err=True))
        except TrainingStopped as e:  # exits as a shell reports a program the signal ended: the run is not finished
            click.echo(str(e), err=True)
            sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        # Ctrl-C before the step loop (loading, tokenising), or a second one in it: the run's stop handling saves
        # nothing then; click would say only `Aborted!`.
        ckpt = run_dir / "ckpt.pt"
        if ckpt.is_file():
            fail(f"interrupted (Ctrl-C) without saving: {ckpt} holds the run as of its last checkpoint, and the same "
                 "command resumes it from there", 130)
        fail(f"interrupted (Ctrl-C): nothing was saved ({run_dir} has no checkpoint yet); the same command starts the "
             "run again", 130)
    click.echo(f"trained to step {state['step']} ({state['tokens']:,} tokens) in {run_dir}")


@train.command("shards")
@click.option("--run", "run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@user_errors
def train_shards(run_dir: Path, out: Path) -> None:
    """Write RUN's checkpoint as bf16 weight shards of at most 15 MiB (how weights leave a lent GPU machine)."""
    from m31r.train.shards import write_shards

    for p in write_shards(run_dir / "ckpt.pt", out):
        click.echo(p)


@train.command("import-shards")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--run", "run_dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--force", is_flag=True, help="Replace RUN's checkpoint when it has one (refused without).")
@user_errors
def train_import_shards(folder: Path, run_dir: Path, force: bool) -> None:
    """Make RUN's checkpoint from shards written by `m31r train shards` (no optimizer state)."""
    from m31r.train.shards import import_shards

    state = import_shards(folder, run_dir, force=force)
    click.echo(f"{run_dir / 'ckpt.pt'}: step {state['step']}, {state['tokens']:,} tokens")


@train.command("export")
@click.option("--run", "run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--data", "data_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--model-version", default="0.1.0", show_default=True)
@user_errors
def train_export(run_dir: Path, data_dir: Path, out: Path, model_version: str) -> None:
    """Write the run's latest checkpoint as a release bundle (bf16 weights, full metadata)."""
    from m31r.train.trainer import export

    # (SIGTERM runs export's clean-up: its half-written folder goes, OUT stays as it was)
    with sigterm_ends(f"{out}: terminated (SIGTERM) before the new bundle was whole; {out} is as it was"):
        b = export(run_dir, data_dir, out, model_version=model_version, log=lambda s: click.echo(s, err=True))
    click.echo(bundle_summary(b))  # OUT replaced once the new bundle is whole
