//! The source half of the layering check: finds names in offload-core's code that mean I/O,
//! clocks, threads, randomness or `unsafe`. Comments and string literals are blanked out first,
//! so prose that mentions `std::fs` is fine; `use std::{fs, ...}` groups are seen through.

use std::path::{Path, PathBuf};

use crate::Error;

/// Modules of `std` the core must not use (as `std::NAME` or inside `std::{...}`).
pub const FORBIDDEN_STD_MODULES: &[&str] = &["fs", "net", "time", "thread", "process", "env"];

/// Identifiers the core must not use at all.
pub const FORBIDDEN_IDENTS: &[&str] = &["Instant", "SystemTime", "unsafe"];

/// Crates whose paths (`NAME::...`) the core must not use.
pub const FORBIDDEN_CRATE_PATHS: &[&str] = &["rand"];

/// One forbidden name found in a source file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    /// 1-based line number.
    pub line: usize,
    /// What was found, e.g. `std::fs`, `std::{time}`, `rand::` or `unsafe`.
    pub pattern: String,
}

/// Every `.rs` file under `dir`, recursively, in sorted order.
pub fn rust_files(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = std::fs::read_dir(&dir)
            .map_err(|err| Error::new(format!("cannot list {}: {err}", dir.display())))?;
        for entry in entries {
            let path = entry
                .map_err(|err| Error::new(format!("cannot list {}: {err}", dir.display())))?
                .path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Finds the forbidden names in one Rust source text.
pub fn scan(text: &str) -> Vec<Hit> {
    let tokens = tokenize(&code_only(text));
    let mut hits = Vec::new();
    for (index, (line, token)) in tokens.iter().enumerate() {
        let Token::Ident(name) = token else {
            continue;
        };
        let next = tokens.get(index + 1).map(|(_, token)| token);
        if FORBIDDEN_IDENTS.contains(&name.as_str()) {
            hits.push(Hit {
                line: *line,
                pattern: name.clone(),
            });
        }
        if FORBIDDEN_CRATE_PATHS.contains(&name.as_str()) && next == Some(&Token::PathSep) {
            hits.push(Hit {
                line: *line,
                pattern: format!("{name}::"),
            });
        }
        if name == "std" && next == Some(&Token::PathSep) {
            scan_std_path(&tokens[index + 2..], &mut hits);
        }
    }
    hits
}

/// Looks at what follows `std::`: a forbidden module, or a `{...}` group naming one.
fn scan_std_path(rest: &[(usize, Token)], hits: &mut Vec<Hit>) {
    match rest.first() {
        Some((line, Token::Ident(module))) if FORBIDDEN_STD_MODULES.contains(&module.as_str()) => {
            hits.push(Hit {
                line: *line,
                pattern: format!("std::{module}"),
            });
        }
        Some((_, Token::Open)) => scan_std_group(&rest[1..], hits),
        _ => {}
    }
}

/// Scans the items of a `std::{...}` group (just after its `{`) for forbidden modules.
fn scan_std_group(rest: &[(usize, Token)], hits: &mut Vec<Hit>) {
    let mut depth = 1;
    let mut item_start = true;
    for (line, token) in rest {
        match token {
            Token::Open => depth += 1,
            Token::Close => depth -= 1,
            Token::Comma if depth == 1 => {
                item_start = true;
                continue;
            }
            Token::Ident(module)
                if depth == 1 && item_start && FORBIDDEN_STD_MODULES.contains(&module.as_str()) =>
            {
                hits.push(Hit {
                    line: *line,
                    pattern: format!("std::{{{module}}}"),
                });
            }
            _ => {}
        }
        if depth == 0 {
            return;
        }
        item_start = false;
    }
}

/// The few token kinds the scan needs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    PathSep,
    Open,
    Close,
    Comma,
    Other,
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_continue(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Splits code (already free of comments and literals) into tokens with their 1-based lines.
fn tokenize(code: &str) -> Vec<(usize, Token)> {
    let chars: Vec<char> = code.chars().collect();
    let mut tokens = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
            continue;
        }
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if is_ident_start(c) {
            let start = i;
            while i < chars.len() && is_ident_continue(chars[i]) {
                i += 1;
            }
            tokens.push((line, Token::Ident(chars[start..i].iter().collect())));
            continue;
        }
        let token = match c {
            ':' if chars.get(i + 1) == Some(&':') => {
                i += 1;
                Token::PathSep
            }
            '{' => Token::Open,
            '}' => Token::Close,
            ',' => Token::Comma,
            _ => Token::Other,
        };
        tokens.push((line, token));
        i += 1;
    }
    tokens
}

/// `c` blanked out: line breaks stay so that line numbers survive, all else becomes a space.
fn blank(c: char) -> char {
    if c == '\n' {
        '\n'
    } else {
        ' '
    }
}

/// `text` with comments and the contents of string and character literals blanked out.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        i = match c {
            '/' if next == Some('/') => skip_line_comment(&chars, i, &mut out),
            '/' if next == Some('*') => skip_block_comment(&chars, i, &mut out),
            '"' => skip_string(&chars, i, &mut out),
            '\'' => skip_char_or_lifetime(&chars, i, &mut out),
            c if is_ident_start(c) => copy_ident_or_raw_string(&chars, i, &mut out),
            c => {
                out.push(c);
                i + 1
            }
        };
    }
    out
}

fn skip_line_comment(chars: &[char], mut i: usize, out: &mut String) -> usize {
    while i < chars.len() && chars[i] != '\n' {
        out.push(' ');
        i += 1;
    }
    i
}

fn skip_block_comment(chars: &[char], mut i: usize, out: &mut String) -> usize {
    let mut depth = 0;
    while i < chars.len() {
        let pair = (chars[i], chars.get(i + 1).copied());
        if pair == ('/', Some('*')) || pair == ('*', Some('/')) {
            depth += if pair.0 == '/' { 1 } else { -1 };
            out.push_str("  ");
            i += 2;
            if depth == 0 {
                break;
            }
            continue;
        }
        out.push(blank(chars[i]));
        i += 1;
    }
    i
}

/// Skips a `"..."` literal starting at the quote at `i`.
fn skip_string(chars: &[char], mut i: usize, out: &mut String) -> usize {
    out.push(' ');
    i += 1;
    while i < chars.len() {
        let c = chars[i];
        out.push(blank(c));
        i += 1;
        if c == '\\' {
            if let Some(&escaped) = chars.get(i) {
                out.push(blank(escaped));
                i += 1;
            }
        } else if c == '"' {
            break;
        }
    }
    i
}

/// Skips a character literal (`'a'`, `'\n'`, `'\u{1F600}'`) at `i`, or copies a lifetime's quote.
fn skip_char_or_lifetime(chars: &[char], i: usize, out: &mut String) -> usize {
    let next = chars.get(i + 1).copied();
    let is_char_literal = next == Some('\\') || chars.get(i + 2) == Some(&'\'');
    if !is_char_literal {
        out.push('\'');
        return i + 1;
    }
    let mut j = i + 1;
    while j < chars.len() {
        let c = chars[j];
        j += 1;
        if c == '\\' {
            j += 1;
        } else if c == '\'' || c == '\n' {
            break;
        }
    }
    let end = j.min(chars.len());
    out.extend(chars[i..end].iter().map(|&c| blank(c)));
    end
}

/// Copies an identifier; when it is a raw-string prefix (`r`, `br`, `cr`) followed by `#...#"`
/// or `"`, skips the raw string too.
fn copy_ident_or_raw_string(chars: &[char], mut i: usize, out: &mut String) -> usize {
    let start = i;
    while i < chars.len() && is_ident_continue(chars[i]) {
        i += 1;
    }
    let ident: String = chars[start..i].iter().collect();
    out.push_str(&ident);
    if !matches!(ident.as_str(), "r" | "br" | "cr") {
        return i;
    }
    let hashes = chars[i..].iter().take_while(|&&c| c == '#').count();
    if chars.get(i + hashes) != Some(&'"') {
        return i;
    }
    let body = i + hashes + 1;
    let mut j = body;
    while j < chars.len() {
        let closes =
            chars[j] == '"' && chars[j + 1..].iter().take_while(|&&c| c == '#').count() >= hashes;
        if closes {
            j += 1 + hashes;
            break;
        }
        j += 1;
    }
    let end = j.min(chars.len());
    out.extend(chars[i..end].iter().map(|&c| blank(c)));
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns(text: &str) -> Vec<(usize, String)> {
        scan(text)
            .into_iter()
            .map(|hit| (hit.line, hit.pattern))
            .collect()
    }

    #[test]
    fn finds_each_forbidden_name_with_its_line() {
        let text = "use std::fs::File;\n\
                    fn f() { let t = std::time::Instant::now(); }\n\
                    use std::{collections::BTreeMap, net, thread::spawn};\n\
                    fn g() -> u8 { rand::random() }\n\
                    unsafe fn h() {}\n\
                    fn i() { let _ = std::env::var(\"X\"); std::process::exit(0) }\n\
                    fn j() -> SystemTime { todo!() }\n";
        assert_eq!(
            patterns(text),
            vec![
                (1, "std::fs".into()),
                (2, "std::time".into()),
                (2, "Instant".into()),
                (3, "std::{net}".into()),
                (3, "std::{thread}".into()),
                (4, "rand::".into()),
                (5, "unsafe".into()),
                (6, "std::env".into()),
                (6, "std::process".into()),
                (7, "SystemTime".into()),
            ]
        );
    }

    #[test]
    fn ignores_comments_strings_and_lookalikes() {
        let text = "#![forbid(unsafe_code)]\n\
                    //! No std::fs here; the caller's `unsafe` business.\n\
                    /* std::time /* nested Instant */ still comment */\n\
                    const A: &str = \"std::net and \\\" unsafe\";\n\
                    const B: &str = r#\"std::thread \"quoted\" \"#;\n\
                    const C: char = '\"';\n\
                    fn f<'a>(x: &'a str) -> &'a str { x }\n\
                    use std::collections::{fs_like, BTreeMap};\n\
                    struct Randomness; fn instant() {} // Instant\n\
                    use core::time::Duration;\n\
                    fn g() -> my::rand_table::T { todo!() }\n";
        assert_eq!(patterns(text), vec![]);
    }

    #[test]
    fn line_numbers_survive_multiline_comments_and_strings() {
        let text = "/* one\ntwo\n*/\nconst S: &str = \"a\nb\";\nuse std::thread;\n";
        assert_eq!(patterns(text), vec![(6, "std::thread".into())]);
    }

    #[test]
    fn nested_groups_only_count_top_level_items() {
        let text = "use std::{sync::{Arc, fs}, time::Duration};\n";
        assert_eq!(patterns(text), vec![(1, "std::{time}".into())]);
    }
}
