"""Lua scripts of the Redis quota store (router/quota.py), as strings so packaging is trivial.

All keys of one tenant share the hash tag `{tenant}` (`kvmesh:{acme}:...`), so each script
touches one Redis Cluster slot and runs atomically there. Time comes from Redis `TIME`
inside the script, never from a router's clock: several replicas with skewed clocks still
refill one bucket consistently (Redis >= 5 replicates scripts by effect, so TIME is allowed).
Every script takes one extra, last ARGV: 0 in service (use TIME), or a test clock in microseconds.

Keys (per tenant):
    KEYS[1] kvmesh:{t}:prompt_bucket   hash {tokens, ts_us}   prompt-token bucket
    KEYS[2] kvmesh:{t}:output_bucket   hash {tokens, ts_us}   output-token bucket
    KEYS[3] kvmesh:{t}:inflight        zset member=reservation id, score=lease expiry (ms)
    KEYS[4] kvmesh:{t}:inflight_kv     hash reservation id -> reserved KV tokens

A bucket holds one minute of its rate (capacity = tokens_per_minute) and refills at
capacity / 60 tokens per second. A limit of -1 means unlimited. Reservations carry a lease so
that a router replica that dies between reserve and settle cannot leak concurrency forever.
"""

# Shared helpers: refill a bucket to `now_us` and return its current token count.
_REFILL = """
local function now_us()
  -- The last ARGV of every script: 0 = Redis TIME (always, in service); a test's injected
  -- clock otherwise, so its assertions need no allowance for elapsed time.
  local injected = tonumber(ARGV[#ARGV])
  if injected ~= nil and injected > 0 then
    return injected
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- now_us has 16 digits; tostring keeps only 14 significant ones, so format it whole.
local function refill(key, capacity, now)
  local state = redis.call('HMGET', key, 'tokens', 'ts_us')
  local tokens = tonumber(state[1])
  local ts = tonumber(state[2])
  if tokens == nil then
    return capacity
  end
  local elapsed_s = math.max(0, now - ts) / 1000000
  return math.min(capacity, tokens + elapsed_s * capacity / 60)
end

-- Store a bucket; it expires once it would have refilled to full anyway (a missing bucket
-- reads as full), so idle or removed tenants leave no keys behind.
local function save_bucket(key, tokens, capacity, now)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts_us', string.format('%.0f', now))
  local refill_ms = math.ceil(math.max(0, capacity - tokens) * 60000 / capacity)
  redis.call('PEXPIRE', key, refill_ms + 1000)
end

local function purge_expired(inflight, inflight_kv, now_ms)
  local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', now_ms)
  for _, id in ipairs(expired) do
    redis.call('ZREM', inflight, id)
    redis.call('HDEL', inflight_kv, id)
  end
end

local function kv_in_use(inflight_kv)
  local total = 0
  for _, v in ipairs(redis.call('HVALS', inflight_kv)) do
    total = total + tonumber(v)
  end
  return total
end
"""

# ARGV: reservation id, prompt tokens, max tokens, prompt cap, output cap,
#       max concurrent requests, max concurrent KV tokens, lease (ms)   (caps/limits: -1 = none)
# Returns {1, '', 0} when admitted, else {0, reason, retry_after_ms}.
RESERVE = _REFILL + """
local id = ARGV[1]
local prompt = tonumber(ARGV[2])
local max_tokens = tonumber(ARGV[3])
local prompt_cap = tonumber(ARGV[4])
local output_cap = tonumber(ARGV[5])
local max_requests = tonumber(ARGV[6])
local max_kv = tonumber(ARGV[7])
local lease_ms = tonumber(ARGV[8])

local now = now_us()
local now_ms = math.floor(now / 1000)
purge_expired(KEYS[3], KEYS[4], now_ms)

if max_requests >= 0 and redis.call('ZCARD', KEYS[3]) >= max_requests then
  return {0, 'max_concurrent_requests', -1}
end
if max_kv >= 0 and kv_in_use(KEYS[4]) + prompt + max_tokens > max_kv then
  return {0, 'max_concurrent_kv_tokens', -1}
end

local prompt_tokens_now = 0
local output_tokens_now = 0
local wait_s = 0
if prompt_cap >= 0 then
  prompt_tokens_now = refill(KEYS[1], prompt_cap, now)
  if prompt_tokens_now < prompt then
    wait_s = math.max(wait_s, (prompt - prompt_tokens_now) * 60 / prompt_cap)
  end
end
if output_cap >= 0 then
  output_tokens_now = refill(KEYS[2], output_cap, now)
  if output_tokens_now < max_tokens then
    wait_s = math.max(wait_s, (max_tokens - output_tokens_now) * 60 / output_cap)
  end
end
if wait_s > 0 then
  return {0, 'tokens_per_minute', math.ceil(wait_s * 1000)}
end

if prompt_cap >= 0 then
  save_bucket(KEYS[1], prompt_tokens_now - prompt, prompt_cap, now)
end
if output_cap >= 0 then
  save_bucket(KEYS[2], output_tokens_now - max_tokens, output_cap, now)
end
redis.call('ZADD', KEYS[3], now_ms + lease_ms, id)
redis.call('HSET', KEYS[4], id, prompt + max_tokens)
return {1, '', 0}
"""

# ARGV: reservation id, prompt tokens to refund, output tokens to refund (negative = charge),
#       prompt cap, output cap.
# Refunds only if the reservation was still in flight, so a repeated settle is a no-op.
# Returns 1 if this call settled the reservation, 0 if it was already settled or expired.
SETTLE = _REFILL + """
local id = ARGV[1]
local refund_prompt = tonumber(ARGV[2])
local refund_output = tonumber(ARGV[3])
local prompt_cap = tonumber(ARGV[4])
local output_cap = tonumber(ARGV[5])

if redis.call('ZREM', KEYS[3], id) == 0 then
  return 0
end
redis.call('HDEL', KEYS[4], id)
local now = now_us()
if prompt_cap >= 0 and refund_prompt ~= 0 then
  local tokens = math.min(prompt_cap, refill(KEYS[1], prompt_cap, now) + refund_prompt)
  save_bucket(KEYS[1], tokens, prompt_cap, now)
end
if output_cap >= 0 and refund_output ~= 0 then
  local tokens = math.min(output_cap, refill(KEYS[2], output_cap, now) + refund_output)
  save_bucket(KEYS[2], tokens, output_cap, now)
end
return 1
"""

# ARGV: prompt cap, output cap (-1 = none). Returns {requests in flight, KV tokens in flight,
#       prompt bucket tokens, output bucket tokens} (bucket = 'none' when unlimited), floats as strings.
USAGE = _REFILL + """
local prompt_cap = tonumber(ARGV[1])
local output_cap = tonumber(ARGV[2])
local now = now_us()
purge_expired(KEYS[3], KEYS[4], math.floor(now / 1000))
local p = 'none'
local o = 'none'
if prompt_cap >= 0 then p = tostring(refill(KEYS[1], prompt_cap, now)) end
if output_cap >= 0 then o = tostring(refill(KEYS[2], output_cap, now)) end
return {redis.call('ZCARD', KEYS[3]), kv_in_use(KEYS[4]), p, o}
"""
