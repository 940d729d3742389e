//! The direct path to a byte-level BPE's token ids (`gateway/src/tokenize/fast.rs`) against the
//! `tokenizers` crate's whole pipeline, on any text (invalid UTF-8 replaced), with and without
//! special tokens. The tokenizers are small ones of the three shapes it takes, with the real split
//! patterns, normalizer, added tokens and post-processors (`gateway/src/tokenize/toy.rs`): the
//! real files take longer to load under the fuzzer's instrumentation than it gives an input (the
//! unit tests compare on those).
#![no_main]

use std::sync::OnceLock;

use baton_gateway::tokenize::fast::Fast;
use baton_gateway::tokenize::toy::{Shape, tokenizer};
use libfuzzer_sys::fuzz_target;

type Pair = (tokenizers::Tokenizer, Box<Fast>);

fn pairs() -> &'static [Pair] {
    static PAIRS: OnceLock<Vec<Pair>> = OnceLock::new();
    PAIRS.get_or_init(|| {
        [Shape::Qwen3, Shape::Llama3, Shape::Gpt2]
            .into_iter()
            .map(|shape| {
                let tok = tokenizer(shape).unwrap();
                let fast = Fast::new(&tok).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
                (tok, fast)
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for (tok, fast) in pairs() {
        for special in [false, true] {
            let want = tok.encode_fast(text.as_ref(), special).unwrap().get_ids().to_vec();
            assert_eq!(fast.encode(tok, &text, special).unwrap(), want);
        }
    }
});
