//! Small tokenizers of the three shapes the direct path takes ([`super::fast`]): the real
//! tokenizers' split patterns, normalizers, kinds of added tokens and post-processors, over a
//! vocabulary of the 256 byte-level characters and a few dozen merges. For the unit tests, beside
//! the real Llama 3.1 and Qwen3 files, and for the `tokenize` fuzz target, which cannot load an
//! 11 MB `tokenizer.json` under its coverage instrumentation in the time libFuzzer gives an input.
//! The BPE model is `tokenizers`' own on both paths, so a small vocabulary tests what differs.
//! Built with the `toy-tokenizers` feature (the fuzz target's) and in tests.

use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::fast::{LLAMA3_PATTERN, QWEN_PATTERN};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// NFC, Qwen's pattern, special and plain added tokens (`<think>`), no BOS.
    Qwen3,
    /// No normalizer, Llama 3's pattern, a BOS put first by a template.
    Llama3,
    /// `ByteLevel` with GPT-2's regex (as `scripts/make-tiny-model` trains for the vLLM tests), BOS.
    Gpt2,
}

/// Merges of common English pieces, in the byte-level alphabet (`Ġ` a space, `Ċ` a newline).
const MERGES: &[&str] = &[
    "t h",
    "th e",
    "Ġ t",
    "Ġt h",
    "Ġth e",
    "i n",
    "in g",
    "e r",
    "a n",
    "Ġ a",
    "Ġa n",
    "Ġan d",
    "r e",
    "o n",
    "Ġ o",
    "Ġo n",
    "e d",
    "Ġ w",
    "o r",
    "1 2",
    "12 3",
    "' s",
    "Ġ Ġ",
    "ĠĠ ĠĠ",
    "Ċ Ċ",
    "Ġ Ċ",
    "Ã ©",
    "ä ¸",
    ". .",
    ".. .",
];

/// A tokenizer of `shape` (an error only if `tokenizers` refuses what it is built of).
pub fn tokenizer(shape: Shape) -> Result<Tokenizer, String> {
    let mut vocab: ahash::AHashMap<String, u32> =
        super::fast::byte_chars().iter().map(char::to_string).zip(0..).collect();
    let merges: Vec<(String, String)> =
        MERGES.iter().filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned()))).collect();
    for (a, b) in &merges {
        let next = u32::try_from(vocab.len()).unwrap_or(u32::MAX);
        vocab.entry(format!("{a}{b}")).or_insert(next);
    }
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| e.to_string())?;
    let mut tok = Tokenizer::new(bpe);
    let split = |pattern: &str| {
        let split = Split::new(SplitPattern::Regex(pattern.into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(Sequence::new(vec![
            PreTokenizerWrapper::Split(split),
            ByteLevel::new(false, false, false).into(),
        ]))
    };
    let special = |names: &[&str]| names.iter().map(|n| AddedToken::from(*n, true)).collect::<Vec<_>>();
    match shape {
        Shape::Qwen3 => {
            tok.with_normalizer(Some(NFC));
            tok.with_pre_tokenizer(Some(split(QWEN_PATTERN)?));
            tok.add_special_tokens(&special(&["<|endoftext|>", "<|im_start|>", "<|im_end|>"]));
            let plain =
                ["<think>", "</think>", "<tool_call>"].map(|n| AddedToken::from(n, false).normalized(false));
            tok.add_tokens(&plain);
            tok.with_post_processor(Some(ByteLevel::new(false, false, false)));
        }
        Shape::Llama3 | Shape::Gpt2 => {
            if shape == Shape::Llama3 {
                tok.with_pre_tokenizer(Some(split(LLAMA3_PATTERN)?));
            } else {
                tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
            }
            tok.add_special_tokens(&special(&["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>"]));
            let bos = tok.token_to_id("<|begin_of_text|>").unwrap_or_default();
            let template =
                TemplateProcessing::builder().try_single("<|begin_of_text|> $A").and_then(|t| {
                    t.special_tokens(vec![("<|begin_of_text|>", bos)]).build().map_err(|e| e.to_string())
                })?;
            tok.with_post_processor(Some(template));
        }
    }
    Ok(tok)
}
