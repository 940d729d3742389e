// Admission by token budget, the JavaScript version of plugins/rust/token-budget: the same config,
// the same decisions (the gateway's tests compare all three languages on one table of requests).
import host from "baton:policy/host@0.2.0";

const DEFAULTS = { tokens_per_minute: 60000, default_max_tokens: 256, low_priority_max_wait_ms: 2000 };
const U32 = 0xffffffff;

function isU32(v) {
  return Number.isInteger(v) && v >= 0 && v <= U32;
}

function parse(json) {
  let raw;
  try {
    raw = JSON.parse(json);
  } catch (e) {
    throw `token-budget config: ${e}`;
  }
  if (raw === null || typeof raw !== "object" || Array.isArray(raw)) {
    throw "token-budget config: not a table";
  }
  const c = { ...DEFAULTS, tenants: {}, unmetered_bands: [] };
  for (const [k, v] of Object.entries(raw)) {
    if (k === "unmetered_bands") {
      if (!Array.isArray(v) || !v.every((b) => typeof b === "string")) {
        throw "token-budget config: unmetered_bands is not a list of strings";
      }
      c.unmetered_bands = v;
    } else if (k === "tenants") {
      if (v === null || typeof v !== "object" || Array.isArray(v)) throw "token-budget config: tenants is not a table";
      for (const [name, t] of Object.entries(v)) {
        if (t === null || typeof t !== "object" || Array.isArray(t)) throw `token-budget config: tenant ${name} is not a table`;
        const tenant = {};
        for (const [tk, tv] of Object.entries(t)) {
          if (tk === "tokens_per_minute") {
            if (!isU32(tv)) throw `token-budget config: tenant ${name}: tokens_per_minute is not a u32`;
            if (tv === 0) throw `token-budget config: tenant ${name}: tokens_per_minute must be above 0`;
            tenant.tokens_per_minute = tv;
          } else if (tk === "priority") {
            if (!isU32(tv) || tv > 255) throw `token-budget config: tenant ${name}: priority is not a u8`;
            if (tv > 7) throw `token-budget config: tenant ${name}: priority must be 0-7`;
            tenant.priority = tv;
          } else {
            throw `token-budget config: tenant ${name}: unknown field ${tk}`;
          }
        }
        c.tenants[name] = tenant;
      }
    } else if (k in DEFAULTS) {
      if (!isU32(v)) throw `token-budget config: ${k} is not a u32`;
      c[k] = v;
    } else {
      throw `token-budget config: unknown field ${k}`;
    }
  }
  if (c.tokens_per_minute === 0) throw "token-budget config: tokens_per_minute must be above 0";
  return c;
}

let cached = null;
function config() {
  if (cached === null) {
    try {
      cached = parse(host.config());
    } catch (e) {
      host.log("error", String(e));
      cached = { ...DEFAULTS, tenants: {}, unmetered_bands: [] };
    }
  }
  return cached;
}

const tenantOf = (req) => (req.tenant === "" ? "anonymous" : req.tenant);
// Whether flow control put the request in a band the budget does not count.
const unmetered = (req, c) => req.band != null && c.unmetered_bands.includes(req.band);
const maxTokens = (req, c) => (req.maxTokens > 0 ? req.maxTokens : c.default_max_tokens);

export const admissionPolicy = {
  validateConfig(json) {
    parse(json);
  },

  admit(req, queue) {
    const c = config();
    if (unmetered(req, c)) return { tag: "admit", val: 0 };
    const name = tenantOf(req);
    const t = Object.prototype.hasOwnProperty.call(c.tenants, name) ? c.tenants[name] : {};
    const tpm = t.tokens_per_minute ?? c.tokens_per_minute;
    let cls = t.priority ?? 0;
    if (req.priority === "low") cls = 0;
    const cost = Math.min(req.promptTokens + maxTokens(req, c), U32);
    if (cost > tpm) {
      return {
        tag: "reject",
        val: {
          status: 400,
          message: `request needs ${cost} tokens, more than tenant ${name}'s budget of ${tpm} tokens per minute`,
          retryAfterS: null,
        },
      };
    }
    const s = host.bucketTake(`tpm/${name}`, tpm, tpm, cost);
    if (!s.taken) {
      return {
        tag: "reject",
        val: {
          status: 429,
          message: `tenant ${name} is over its budget of ${tpm} tokens per minute`,
          retryAfterS: Math.max(1, Math.ceil(s.retryAfterMs / 1000)),
        },
      };
    }
    if (cls === 0 && queue.freeSlots < req.slots) {
      return { tag: "queue", val: { priority: 0, maxWaitMs: c.low_priority_max_wait_ms } };
    }
    return { tag: "admit", val: cls };
  },

  onComplete(req, usage) {
    const c = config();
    if (unmetered(req, c)) return;
    const unused = Math.max(0, maxTokens(req, c) - usage.completionTokens);
    if (unused > 0) host.bucketGive(`tpm/${tenantOf(req)}`, unused);
  },
};
