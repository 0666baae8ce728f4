-- wrk load for bench/replicas_bench.py: closed loops of POST /v1/new, then POST /v1/mark_free of an
-- id whose decision has come back. Request ids are unique per request.
--
-- wrk's request() does not say which connection it is for, so a free goes out on whichever of the
-- thread's connections asks next: run one connection per thread (-t N -c N), so that each free
-- follows its own booking on the same connection, whichever --processes child the kernel gave it.
--
-- Configured through the environment (wrk's setup() sees no script arguments):
--   WRK_PORTS   comma-separated loopback ports; thread i drives port i mod N
--   WRK_BODIES  a file with one JSON token array per line (the prompts, used round robin)
--   WRK_TAG     a prefix that makes this run's request ids unique
-- done() prints one JSON line: decisions answered, frees answered, failed replies, socket errors.

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
local booked = 0
local to_free = {}  -- ids whose decision came back; each is freed by one of this thread's next requests
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

-- A decision names its request id and worker; a free's reply names no worker.
function response(status, _, body)
  if status ~= 200 then
    failures = failures + 1
    failure = status .. " " .. string.sub(body, 1, 200)
  elseif string.find(body, '"worker_id"', 1, true) then
    decisions = decisions + 1
    to_free[#to_free + 1] = string.match(body, '"request_id":"([^"]+)"')
  else
    frees = frees + 1
  end
end

function done(summary)
  local totals = { decisions = 0, frees = 0, failures = 0 }
  local failure = ""
  for _, thread in ipairs(threads) do
    for name in pairs(totals) do
      totals[name] = totals[name] + thread:get(name)
    end
    failure = thread:get("failure") or failure
  end
  io.write(string.format('{"decisions": %d, "frees": %d, "failures": %d, "socket_errors": %d, "duration_s": %f, '
    .. '"a_failure": "%s"}\n', totals.decisions, totals.frees, totals.failures,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    summary.duration / 1e6, string.gsub(failure, '["\\]', "'")))
end
