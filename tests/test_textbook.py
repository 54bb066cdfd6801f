"""Textbook pieces (m31r.train.textbook): doc-test examples and documented functions cut out of crate files."""

from __future__ import annotations

import json
from pathlib import Path

from m31r.train.textbook import build_textbook, doc_examples, documented_functions

LIB = '''\
//! Small numeric helpers.
//!
//! ```
//! use nums::gcd;
//! assert_eq!(gcd(12, 18), 6);
//! assert_eq!(gcd(7, 0), 7);
//! ```

/// Returns the greatest common divisor of `a` and `b`.
///
/// ```text
/// gcd(a, 0) = a
/// ```
///
/// Not Rust, though the closing fence above could be mistaken for an opening one:
///
/// ```
/// # use nums::gcd;
/// #
/// let g = gcd(4, 6);
/// assert_eq!(g, 2);
/// # assert_eq!(gcd(0, 0), 0);
/// ```
#[inline]
#[must_use]
pub fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        let t = b;
        b = a % b;
        a = t;
    }
    a
}

pub fn undocumented(x: u32) -> u32 {
    let y = x + 1;
    y * 2
}

/// Too short a body to teach anything.
pub fn one(x: u32) -> u32 {
    x
}

impl Meter {
    /// The length in centimetres.
    pub fn centimetres(&self) -> f64 {
        let cm = self.0 * 100.0;
        cm
    }
}

/// ```compile_fail
/// let x: u32 = "no";
/// let y = 1;
/// let z = 2;
/// ```
/// ```rust,no_run
/// fn main() {
///     let v = vec![1, 2, 3];
///     println!("{}", v.len());
/// }
/// ```
pub struct Meter(f64);
'''


def test_doc_examples_become_programs():
    ex = doc_examples(LIB)
    assert ex[0] == ("fn main() {\n    use nums::gcd;\n    assert_eq!(gcd(12, 18), 6);\n"
                     "    assert_eq!(gcd(7, 0), 7);\n}\n")
    # rustdoc's hidden lines are code; a bare `#` is an empty line
    assert ex[1] == ("fn main() {\n    use nums::gcd;\n\n    let g = gcd(4, 6);\n    assert_eq!(g, 2);\n"
                     "    assert_eq!(gcd(0, 0), 0);\n}\n")
    # a program with its own main is not wrapped again
    assert ex[2] == 'fn main() {\n    let v = vec![1, 2, 3];\n    println!("{}", v.len());\n}\n'
    assert len(ex) == 3  # the text block, the compile_fail block and nothing of the prose between fences


def test_an_unclosed_fence_or_a_short_example_gives_nothing():
    assert doc_examples("/// ```\n/// let a = 1;\n/// let b = 2;\n/// let c = 3;\nfn f() {}\n") == []
    assert doc_examples("/// ```\n/// let a = 1;\n/// // a comment is not code\n/// ```\n") == []


def test_documented_functions_with_their_attributes_at_the_left_margin():
    fns = documented_functions(LIB)
    assert len(fns) == 2
    assert fns[0].startswith("/// Returns the greatest common divisor")
    assert "#[inline]\n#[must_use]\npub fn gcd(" in fns[0] and fns[0].endswith("    a\n}\n")
    assert fns[1] == ("/// The length in centimetres.\npub fn centimetres(&self) -> f64 {\n"
                      "    let cm = self.0 * 100.0;\n    cm\n}\n")


def test_build_mixes_pieces_with_whole_files_and_keeps_validation(tmp_path: Path):
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    filler = "fn filler() {\n    let n = 0;\n}\n" * 40
    train = [{"path": "registry/nums-1.0.0/src/lib.rs", "crate": "nums", "text": LIB},
             {"path": "registry/nums-1.0.0/src/copy.rs", "crate": "nums", "text": LIB},  # pieces are kept once
             *({"path": f"registry/other-1.0.0/src/f{i}.rs", "crate": "other", "text": filler} for i in range(20))]
    (data / "corpus" / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in train))
    (data / "corpus" / "val.jsonl").write_text(json.dumps({"path": "v.rs", "crate": "v", "text": "fn v() {}\n"}) + "\n")
    (data / "corpus" / "manifest.json").write_text(json.dumps({"dataset_version": "base"}))
    (data / "tokenizer.json").write_text("{}")

    out = tmp_path / "tb"
    m = build_textbook(data, out, plain_share=1.0, seed=3)
    docs = [json.loads(line) for line in (out / "corpus" / "train.jsonl").read_text().splitlines()]
    pieces = [d for d in docs if "#" in d["path"]]
    assert len(pieces) == 5 and m["textbook"]["examples"] == 3 and m["textbook"]["functions"] == 2
    assert {d["crate"] for d in pieces} == {"nums"}
    whole = [d for d in docs if "#" not in d["path"]]
    assert whole and m["textbook"]["plain_files"] == len(whole)
    # whole files are added until they match the pieces' characters, not beyond one file past it
    piece_chars = sum(len(d["text"]) for d in pieces)
    assert piece_chars <= sum(len(d["text"]) for d in whole) < piece_chars + len(filler) + len(LIB)
    assert (out / "corpus" / "val.jsonl").read_text() == (data / "corpus" / "val.jsonl").read_text()
    assert (out / "tokenizer.json").read_text() == "{}"
    assert m["dataset_version"].startswith("base+textbook-")
    assert json.loads((out / "corpus" / "manifest.json").read_text())["dataset_version"] == m["dataset_version"]
    # the same inputs and seed give the same folder
    again = build_textbook(data, tmp_path / "tb2", plain_share=1.0, seed=3)
    assert again["dataset_version"] == m["dataset_version"]
    assert build_textbook(data, tmp_path / "tb3", plain_share=0.0, seed=3)["textbook"]["plain_files"] == 0
