//! A lower bound on a text's token count, known without tokenizing it, so a prompt far beyond the
//! model's context is refused at once instead of after seconds of BPE (a 3.6 MB prompt costs a
//! byte-level BPE about 7.8 s of CPU; the bound takes a division).
//!
//! Why it holds: a token stands for at most `longest` bytes of the text the model sees, where
//! `longest` is the longest vocabulary entry (added tokens included) in UTF-8 bytes. Byte-level
//! BPE maps each input byte to one character of one or two bytes, Metaspace turns a one-byte space
//! into the three-byte `▁`, byte-fallback tokens (`<0x0A>`) are longer than the byte they stand
//! for: none of them makes the text shorter, so `ceil(text bytes / longest)` tokens are needed at
//! least. What could make the text shorter is taken into account or turns the bound off:
//! - Unicode normalizers and lowercasing shrink a text by less than [`SHRINK`] (the worst known:
//!   the Kelvin sign, three bytes, lowercases to `k`; three Hangul jamo compose into one syllable);
//! - normalizers that strip or remove characters (`Strip`, `StripAccents`, `BertNormalizer`,
//!   SentencePiece's `Precompiled` map), pre-tokenizers that drop whitespace or delimiters, added
//!   tokens that take the whitespace beside them (`lstrip`, `rstrip`), BPE models that drop
//!   characters they do not know (no byte-level alphabet, no byte fallback, no unknown token) or
//!   fuse them into one token (`fuse_unk` without byte fallback), WordPiece and Unigram have no
//!   such bound: for them the bound is off and the text is tokenized as before.

use serde_json::Value;

/// How much a Unicode normalizer (NFC, NFKC, NFD, NFKD) or `Lowercase` may shrink a text, at
/// most, in UTF-8 bytes: a four-byte character mapped to a one-byte one (NFKC: U+1D400 `𝐀` → `A`)
/// is the most one character can shrink, and composing characters shrinks less (three Hangul
/// jamo, nine bytes, into one three-byte syllable). Normalizers in sequence multiply.
pub const SHRINK: usize = 4;

/// Bytes of text one token may stand for at most, if the tokenizer has such a bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    pub bytes_per_token: usize,
}

impl Bound {
    /// The bound of a loaded tokenizer, or why there is none.
    pub fn of(tok: &tokenizers::Tokenizer) -> Result<Self, String> {
        let json: Value = serde_json::from_str(&tok.to_string(false).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        let shrink = normalizer_shrink(json.get("normalizer").unwrap_or(&Value::Null))?;
        let pre = json.get("pre_tokenizer").unwrap_or(&Value::Null);
        pre_tokenizer_keeps(pre)?;
        model_keeps(json.get("model").unwrap_or(&Value::Null), byte_level(pre))?;
        added_tokens_keep(json.get("added_tokens").unwrap_or(&Value::Null))?;
        let longest = tok.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        Ok(Self { bytes_per_token: longest.saturating_mul(shrink) })
    }

    /// Tokens a text of `bytes` bytes needs at least.
    pub fn min_tokens(self, bytes: usize) -> u64 {
        bytes.div_ceil(self.bytes_per_token.max(1)) as u64
    }
}

fn kind(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("")
}

/// How much a normalizer may shrink a text (1: not at all), or why it has no bound.
fn normalizer_shrink(n: &Value) -> Result<usize, String> {
    if n.is_null() {
        return Ok(1);
    }
    match kind(n) {
        "Prepend" | "ByteLevel" => Ok(1),
        // A string replaced by one at least as long (SentencePiece's " " → "▁").
        "Replace" => {
            let from = n.pointer("/pattern/String").and_then(Value::as_str);
            let to = n.get("content").and_then(Value::as_str);
            match (from, to) {
                (Some(f), Some(t)) if t.len() >= f.len() => Ok(1),
                _ => Err("the normalizer replaces text with shorter text".to_owned()),
            }
        }
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" => Ok(SHRINK),
        "Sequence" => n.get("normalizers").and_then(Value::as_array).map_or(Ok(1), |all| {
            all.iter().try_fold(1usize, |acc, n| Ok(acc.saturating_mul(normalizer_shrink(n)?)))
        }),
        other => Err(format!("the {other} normalizer may remove text")),
    }
}

/// Whether a pre-tokenizer keeps every byte of its input.
fn pre_tokenizer_keeps(p: &Value) -> Result<(), String> {
    if p.is_null() {
        return Ok(());
    }
    match kind(p) {
        "ByteLevel" | "Metaspace" | "Digits" | "UnicodeScripts" => Ok(()),
        "Split" | "Punctuation" => match p.get("behavior").and_then(Value::as_str) {
            Some("Removed") => Err(format!("the {} pre-tokenizer removes what it splits on", kind(p))),
            _ => Ok(()),
        },
        "Sequence" => p
            .get("pretokenizers")
            .and_then(Value::as_array)
            .map_or(Ok(()), |all| all.iter().try_for_each(pre_tokenizer_keeps)),
        other => Err(format!("the {other} pre-tokenizer drops whitespace or delimiters")),
    }
}

/// Whether a pre-tokenizer maps the text to bytes (`ByteLevel`, alone or in a sequence): its BPE
/// then has a token for every byte, and no character is unknown.
fn byte_level(p: &Value) -> bool {
    match kind(p) {
        "ByteLevel" => true,
        "Sequence" => {
            p.get("pretokenizers").and_then(Value::as_array).is_some_and(|all| all.iter().any(byte_level))
        }
        _ => false,
    }
}

/// Whether the model gives each piece of text tokens of its own: every character known (a
/// byte-level alphabet, or byte fallback's `<0xNN>` tokens), or an unknown one standing for one
/// character each (an unknown token, not fused). A BPE with neither drops what it does not know;
/// fused unknowns stand one token for any run of them.
fn model_keeps(m: &Value, byte_level: bool) -> Result<(), String> {
    match kind(m) {
        "BPE" => {
            let flag = |k: &str| m.get(k).and_then(Value::as_bool).unwrap_or(false);
            let unk = !m.get("unk_token").is_none_or(Value::is_null);
            if byte_level || flag("byte_fallback") || (unk && !flag("fuse_unk")) {
                Ok(())
            } else if unk {
                Err("the BPE model fuses unknown characters into one token".to_owned())
            } else {
                Err("the BPE model drops characters it does not know".to_owned())
            }
        }
        other => Err(format!("the {other} model may stand one token for a whole unknown word")),
    }
}

/// Whether the added tokens match only their own text: one that strips the whitespace beside it
/// (`lstrip`, `rstrip`) stands for any run of spaces as well.
fn added_tokens_keep(added: &Value) -> Result<(), String> {
    let strips = |t: &&Value| {
        t.get("lstrip").and_then(Value::as_bool).unwrap_or(false)
            || t.get("rstrip").and_then(Value::as_bool).unwrap_or(false)
    };
    match added.as_array().and_then(|all| all.iter().find(strips)) {
        Some(t) => Err(format!(
            "the added token {:?} takes the whitespace beside it",
            t.get("content").and_then(Value::as_str).unwrap_or_default()
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn what_keeps_the_text_and_what_does_not() {
        assert_eq!(normalizer_shrink(&Value::Null), Ok(1));
        assert_eq!(normalizer_shrink(&json!({"type": "NFC"})), Ok(SHRINK));
        let sp = json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]});
        assert_eq!(normalizer_shrink(&sp), Ok(1));
        let shorter = json!({"type": "Replace", "pattern": {"String": "  "}, "content": " "});
        assert!(normalizer_shrink(&shorter).is_err());
        assert!(normalizer_shrink(&json!({"type": "BertNormalizer"})).is_err());
        assert!(
            normalizer_shrink(
                &json!({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Strip"}]})
            )
            .is_err()
        );
        let llama3 = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "x"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false}]});
        assert_eq!(pre_tokenizer_keeps(&llama3), Ok(()));
        assert!(pre_tokenizer_keeps(&json!({"type": "Whitespace"})).is_err());
        assert!(pre_tokenizer_keeps(&json!({"type": "Split", "behavior": "Removed"})).is_err());
        // Byte-level BPE (Llama 3, Qwen): every byte is a token.
        assert_eq!(model_keeps(&json!({"type": "BPE", "fuse_unk": false, "unk_token": null}), true), Ok(()));
        assert!(byte_level(&llama3));
        // SentencePiece-converted (Llama 2, Mistral): unknowns fused, but byte fallback covers all.
        let sp = json!({"type": "BPE", "fuse_unk": true, "byte_fallback": true, "unk_token": "<unk>"});
        assert_eq!(model_keeps(&sp, false), Ok(()));
        assert!(model_keeps(&json!({"type": "BPE", "fuse_unk": true, "unk_token": "<unk>"}), false).is_err());
        assert!(model_keeps(&json!({"type": "BPE", "unk_token": null}), false).is_err(), "drops unknowns");
        assert_eq!(model_keeps(&json!({"type": "BPE", "unk_token": "<unk>"}), false), Ok(()));
        assert!(model_keeps(&json!({"type": "WordPiece"}), false).is_err());
        // RoBERTa's <mask> takes the spaces before it.
        assert!(added_tokens_keep(&json!([{"content": "<mask>", "lstrip": true, "rstrip": false}])).is_err());
        assert_eq!(
            added_tokens_keep(&json!([{"content": "<|eot_id|>", "lstrip": false, "rstrip": false}])),
            Ok(())
        );
        assert_eq!(Bound { bytes_per_token: 128 }.min_tokens(129), 2);
        assert_eq!(Bound { bytes_per_token: 128 }.min_tokens(0), 0);
    }
}
