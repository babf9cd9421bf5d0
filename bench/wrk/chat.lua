-- wrk script: POST one chat completion per request, count 200s and Reef receipts.
-- Env: BENCH_URL_PATH (default /v1/chat/completions), BENCH_SCENARIO (x-reef-scenario), BENCH_BODY, BENCH_TOKEN,
-- BENCH_RECEIPTS_DIR (when set, each thread writes the receipt ids it received to <dir>/<thread>.txt).
-- done() prints one line "WRK_JSON {...}" that bench/throughput.py parses.
local threads = {}

wrk.method = "POST"
wrk.path = os.getenv("BENCH_URL_PATH") or "/v1/chat/completions"
wrk.body = os.getenv("BENCH_BODY") or '{"model":"fake-model","messages":[{"role":"user","content":"hi"}]}'
wrk.headers["content-type"] = "application/json"
wrk.headers["authorization"] = "Bearer " .. (os.getenv("BENCH_TOKEN") or "sk-dummy")
wrk.headers["x-reef-scenario"] = os.getenv("BENCH_SCENARIO") or "bench"

function setup(thread)
  table.insert(threads, thread)
  thread:set("index", #threads)
end

function init(args)
  ok = 0
  bad = 0
  receipts = 0
  local dir = os.getenv("BENCH_RECEIPTS_DIR")
  if dir ~= nil and dir ~= "" then
    receipt_file = io.open(dir .. "/" .. tostring(index) .. ".txt", "w")
  end
end

function response(status, headers, body)
  if status == 200 then ok = ok + 1 else bad = bad + 1 end
  local receipt = headers["x-reef-agent-record-id"]
  if receipt ~= nil then
    receipts = receipts + 1
    if receipt_file ~= nil then
      receipt_file:write(receipt, "\n")
      receipt_file:flush()
    end
  end
end

function done(summary, latency, requests)
  local o, b, r = 0, 0, 0
  for _, t in ipairs(threads) do
    o = o + t:get("ok")
    b = b + t:get("bad")
    r = r + t:get("receipts")
  end
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"ok":%d,"bad":%d,"receipts":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"p50":%d,"p99":%d,"mean":%.1f,"max":%d}}\n',
    summary.requests, summary.duration, o, b, r, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean, latency.max))
end
