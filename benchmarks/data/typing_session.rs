//! Line/column bookkeeping for an editor buffer: converting between byte offsets, (line, column)
//! positions in UTF-8 or UTF-16 code units, and applying a batch of text edits.

use std::cmp::Ordering;
use std::fmt;
use std::ops::Range;

/// A zero-based position in a document, as editors report it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Position {
    pub line: u32,
    pub column: u32,
}

impl Position {
    pub const fn new(line: u32, column: u32) -> Self {
        Position { line, column }
    }
}

impl PartialOrd for Position {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Position {
    fn cmp(&self, other: &Self) -> Ordering {
        self.line.cmp(&other.line).then(self.column.cmp(&other.column))
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line + 1, self.column + 1)
    }
}

/// Which unit columns are counted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Utf8,
    Utf16,
}

/// An edit: replace `range` (byte offsets into the old text) with `text`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextEdit {
    pub range: Range<usize>,
    pub text: String,
}

#[derive(Debug, PartialEq, Eq)]
pub enum EditError {
    OutOfBounds { offset: usize, len: usize },
    Overlapping { first: Range<usize>, second: Range<usize> },
    NotCharBoundary(usize),
}

impl fmt::Display for EditError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EditError::OutOfBounds { offset, len } => write!(f, "offset {offset} is past the end ({len})"),
            EditError::Overlapping { first, second } => write!(f, "edits {first:?} and {second:?} overlap"),
            EditError::NotCharBoundary(offset) => write!(f, "offset {offset} is inside a character"),
        }
    }
}

impl std::error::Error for EditError {}

/// Start offsets of every line, computed once per version of the text.
#[derive(Clone, Debug)]
pub struct LineIndex {
    line_starts: Vec<usize>,
    len: usize,
}

impl LineIndex {
    pub fn new(text: &str) -> Self {
        let mut line_starts = vec![0];
        for (i, b) in text.bytes().enumerate() {
            if b == b'\n' {
                line_starts.push(i + 1);
            }
        }
        LineIndex { line_starts, len: text.len() }
    }

    pub fn line_count(&self) -> usize {
        self.line_starts.len()
    }

    /// The byte range of `line`, including its line terminator.
    pub fn line_range(&self, line: u32) -> Option<Range<usize>> {
        let line = line as usize;
        let start = *self.line_starts.get(line)?;
        let end = self.line_starts.get(line + 1).copied().unwrap_or(self.len);
        Some(start..end)
    }

    /// The position of byte `offset`, with the column counted in `encoding` units.
    pub fn position(&self, text: &str, offset: usize, encoding: Encoding) -> Option<Position> {
        if offset > self.len || !text.is_char_boundary(offset) {
            return None;
        }
        let line = self.line_starts.partition_point(|&start| start <= offset) - 1;
        let start = self.line_starts[line];
        let column = match encoding {
            Encoding::Utf8 => offset - start,
            Encoding::Utf16 => text[start..offset].chars().map(char::len_utf16).sum(),
        };
        Some(Position::new(line as u32, column as u32))
    }

    /// The byte offset of `pos`; a column past the end of its line clamps to the line end.
    pub fn offset(&self, text: &str, pos: Position, encoding: Encoding) -> Option<usize> {
        let range = self.line_range(pos.line)?;
        let line = text[range.clone()].trim_end_matches(['\n', '\r']);
        let mut units = 0;
        for (i, ch) in line.char_indices() {
            if units >= pos.column as usize {
                return Some(range.start + i);
            }
            units += match encoding {
                Encoding::Utf8 => ch.len_utf8(),
                Encoding::Utf16 => ch.len_utf16(),
            };
        }
        Some(range.start + line.len())
    }
}

/// Applies `edits` to `text`. Edits refer to the original text and must not overlap; they may come in
/// any order. Returns the new text.
pub fn apply_edits(text: &str, edits: &[TextEdit]) -> Result<String, EditError> {
    let mut sorted: Vec<&TextEdit> = edits.iter().collect();
    sorted.sort_by_key(|edit| (edit.range.start, edit.range.end));
    for pair in sorted.windows(2) {
        if pair[0].range.end > pair[1].range.start {
            return Err(EditError::Overlapping { first: pair[0].range.clone(), second: pair[1].range.clone() });
        }
    }
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    for edit in sorted {
        for offset in [edit.range.start, edit.range.end] {
            if offset > text.len() {
                return Err(EditError::OutOfBounds { offset, len: text.len() });
            }
            if !text.is_char_boundary(offset) {
                return Err(EditError::NotCharBoundary(offset));
            }
        }
        out.push_str(&text[last..edit.range.start]);
        out.push_str(&edit.text);
        last = edit.range.end;
    }
    out.push_str(&text[last..]);
    Ok(out)
}
