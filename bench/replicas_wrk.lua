-- wrk load for bench/replicas_bench.py: every connection runs a closed loop of POST /v1/new, then
-- POST /v1/mark_free of the id that decision booked. Request ids are unique per request.
--
-- Configured through the environment (wrk's setup() sees no script arguments):
--   WRK_PORTS   comma-separated loopback ports; thread i drives port i mod N (one thread per replica)
--   WRK_BODIES  a file with one JSON token array per line (the prompts, used round robin)
--   WRK_TAG     a prefix that makes this run's request ids unique
-- done() prints one JSON line: decisions answered, frees answered, other replies.

local threads = {}

function setup(thread)
  local ports = {}
  for port in string.gmatch(os.getenv("WRK_PORTS"), "%d+") do
    ports[#ports + 1] = port
  end
  local index = #threads
  thread.addr = wrk.lookup("127.0.0.1", ports[index % #ports + 1])[1]
  thread:set("tag", os.getenv("WRK_TAG") .. "-t" .. index)
  threads[#threads + 1] = thread
end

local headers = { ["Content-Type"] = "application/json" }
local bodies = {}
local to_free = {}  -- ids whose decision came back, each freed by the next request of this thread
local booked = 0
decisions = 0
frees = 0
failures = 0

function init(args)
  for line in io.lines(os.getenv("WRK_BODIES")) do
    bodies[#bodies + 1] = line
  end
end

function request()
  local request_id = table.remove(to_free)
  if request_id then
    return wrk.format("POST", "/v1/mark_free", headers, '{"request_id":"' .. request_id .. '"}')
  end
  booked = booked + 1
  local body = '{"request_id":"' .. tag .. "-" .. booked .. '","tokens":' .. bodies[booked % #bodies + 1] .. "}"
  return wrk.format("POST", "/v1/new", headers, body)
end

function response(status, _, body)
  if status ~= 200 then
    failures = failures + 1
  elseif string.find(body, '"worker_id"', 1, true) then
    decisions = decisions + 1
    to_free[#to_free + 1] = string.match(body, '"request_id":"([^"]+)"')
  else
    frees = frees + 1
  end
end

function done(summary)
  local totals = { decisions = 0, frees = 0, failures = 0 }
  for _, thread in ipairs(threads) do
    for name in pairs(totals) do
      totals[name] = totals[name] + thread:get(name)
    end
  end
  io.write(string.format('{"decisions": %d, "frees": %d, "failures": %d, "socket_errors": %d, "duration_s": %f}\n',
    totals.decisions, totals.frees, totals.failures,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.duration / 1e6))
end
