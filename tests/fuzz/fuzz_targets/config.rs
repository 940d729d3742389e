//! The configuration parser: an operator's TOML file, as `baton serve` and `check-config` read it.
//! (Its checks read the files it names, which a fuzzer's paths make unbounded: parsing only.)
#![no_main]

use baton_gateway::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = Config::parse(text);
    }
});
