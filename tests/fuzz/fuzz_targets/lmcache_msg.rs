//! LMCache's PD messages (msgpack, as msgspec writes them: `ProxyNotif`, the allocation request
//! and answer), as the gateway reads a prefiller's notification. Whatever decodes encodes and
//! decodes again to the same message.
#![no_main]

use baton_dataplane::compat::lmcache::PdMsg;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = PdMsg::decode(data) {
        let again = PdMsg::decode(&m.encode().unwrap()).unwrap();
        assert_eq!(format!("{m:?}"), format!("{again:?}"));
    }
});
