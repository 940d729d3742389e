//! Wire formats of today's engines, so baton can sit in front of them before they embed its data
//! plane: ZeroMQ's ZMTP (the side channels) and LMCache's PD messages (msgpack). vLLM's NIXL
//! connector needs nothing here: its hand-off travels in the OpenAI requests' `kv_transfer_params`.

pub mod lmcache;
pub mod zmtp;
