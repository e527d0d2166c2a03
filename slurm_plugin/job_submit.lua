--[[
rgpu job_submit plugin for Slurm (JobSubmitPlugins=lua). Lua 5.1, as Slurm 22.05 links it.

Install: copy this file as job_submit.lua into the directory of slurm.conf (Debian:
/etc/slurm/job_submit.lua; the plugin looks beside $SLURM_CONF), and put job_submit_rgpu.conf
beside it (`rgpu-admin slurm-config` prints one with the pool's live numbers).

What it does for a job that asks for --gres=rgpu:N:
  * reads N from tres_per_node, in both shapes: "gres:rgpu:N" (Slurm <= 23.02) and
    "gres/rgpu:N" (>= 23.11); "gres:rgpu" alone means N = 1;
  * reads fraction=F (default 1.0; whole hundredths of a GPU, 0.01 to 1) or memory=SIZE (per
    slice) from --comment, and isolation=strict (slices only on GPUs shared "isolated" or
    "exclusive", where another job's GPU fault cannot end this one's work); appends "fraction=1"
    to a comment that names no size, so the node Prolog can tell rgpu jobs by their comment;
  * refuses bad requests with a message the user sees (slurm.log_user) and the Slurm error code
    that fits (rgpu.error_code); refuses requests no GPU of the pool can ever serve (pool_gpus,
    isolated_gpus, exclusive_gpus in the config) and heterogeneous jobs asking for rgpu;
  * pins the node count (-N 2 stays 2; no -N means 1 node) and adds the cluster license
    rgpu:<units>, units = nodes x N x units_per_slice, so slurmctld keeps the job PENDING
    (reason Licenses) while the pool cannot serve it.
    units_per_slice = 100 F for fraction=F; for memory=SIZE it is
    ceil(100 x SIZE / gpu_memory_bytes) with gpu_memory_bytes from the config file (the usable
    memory of the smallest GPU in the pool), or 100 (a whole GPU) when that is not configured;
  * with hold_until_placed = 1 (what `rgpu-admin slurm-config` writes), submits the job held
    (priority 0; Slurm shows reason JobHeldUser) and marked in its admin comment: rgpu-poold releases it once the pool
    can place its slices, on distinct GPUs, so a job the license admits but the pool cannot
    place (fragmented GPUs) waits PENDING instead of being started, refused and requeued.

Configuration: job_submit_rgpu.conf beside this script, read on every call (so a change needs
no reconfigure), lines `key = value`, `#` comments. Keys and defaults are in DEFAULTS below. A
broken config file refuses rgpu jobs (with a message naming the file); other jobs are never
touched.

Everything above the "Slurm entry points" line is pure and is unit-tested with the standalone
lua5.1 interpreter (tests/test_job_submit_lua.py).
--]]

local rgpu = {}

rgpu.DEFAULTS = {
	gres_name = "rgpu",          -- the count-only GRES users ask for
	license_name = "rgpu",       -- the cluster license holding the pool's capacity in GPU percent
	max_per_node = 16,           -- most slices per node (N in --gres=rgpu:N)
	max_per_job = 64,            -- most slices per job (nodes x N)
	gpu_memory_bytes = 0,        -- usable memory of the smallest GPU; 0: memory=SIZE counts 100
	pool_gpus = 0,               -- GPUs in the pool; 0: unknown (the checks below are off)
	isolated_gpus = 0,           -- of them shared "isolated" (fractional slices, isolation=strict)
	exclusive_gpus = 0,          -- of them shared "exclusive" (whole-GPU slices only)
	hold_until_placed = 0,       -- 1: submit rgpu jobs held; rgpu-poold releases each once the pool can place it
	release_uid = 0,             -- the pool's uid where it is neither root nor SlurmUser (a Slurm operator); 0: none
}
rgpu.UNITS_PER_GPU = 100
rgpu.CONF_NAME = "job_submit_rgpu.conf"
-- Slurm's "not set" values for node counts.
rgpu.NO_VAL = 4294967294
rgpu.INFINITE = 4294967295
-- ESLURM_INVALID_GRES: sbatch prints "Invalid generic resource (gres) specification". Slurm's Lua
-- API names no such constant; the others below it does (slurm.ESLURM_*).
rgpu.ESLURM_INVALID_GRES = 2072

-- The Slurm error code for a refusal (sbatch prints its text as "...submission failed: <text>"):
-- --gres: "Invalid generic resource (gres) specification"; -L: "Invalid license specification";
-- -N: "Node count specification invalid"; the admin comment or a request only an admin may
-- change: "Access/permission denied"; the comment, the config file, or what the pool can serve:
-- SLURM_ERROR, "Unspecified error" (Slurm has no code for a comment).
function rgpu.error_code(message)
	local kind = rgpu.kinds[message] or "gres"
	if kind == "gres" then
		return rgpu.ESLURM_INVALID_GRES
	end
	local name = ({ license = "ESLURM_INVALID_LICENSES", nodes = "ESLURM_INVALID_NODE_COUNT",
		access = "ESLURM_ACCESS_DENIED" })[kind]
	return (name and slurm[name]) or slurm.ERROR
end

local SIZE_MULT = { [""] = 1, K = 1024, M = 1024 ^ 2, G = 1024 ^ 3, T = 1024 ^ 4 }

-- What each refusal is about, by its message: the entry points return the Slurm error code that
-- fits (sbatch prints its text after rgpu's line), rather than one code for every refusal.
rgpu.kinds = {}

local function fail(what, why, fix, kind)
	local message = string.format("rgpu: job_submit: %s (%s; %s)", what, why, fix)
	rgpu.kinds[message] = kind or "gres"
	return nil, message
end
rgpu.fail = fail

local function trim(s)
	return (string.gsub(s, "^%s*(.-)%s*$", "%1"))
end

local function is_set(n)
	return n ~= nil and n ~= 0 and n < rgpu.NO_VAL
end
rgpu.is_set = is_set

-- Shown values are quoted and cut, and control characters are escaped, so a hostile value
-- cannot forge lines in a log or a terminal.
local function shown(value)
	local s = tostring(value)
	if #s > 40 then
		s = string.sub(s, 1, 37) .. "..."
	end
	s = string.gsub(s, "[%c\128-\255]", function(c) return string.format("\\%03d", string.byte(c)) end)
	return "'" .. s .. "'"
end
rgpu.shown = shown

-- ---------------------------------------------------------------- configuration

-- Parse the text of job_submit_rgpu.conf; returns conf or nil, error.
function rgpu.parse_conf(text, source)
	local conf = {}
	for k, v in pairs(rgpu.DEFAULTS) do
		conf[k] = v
	end
	local lineno = 0
	for line in string.gmatch((text or "") .. "\n", "([^\n]*)\n") do
		lineno = lineno + 1
		line = trim(string.gsub(line, "#.*$", ""))
		if line ~= "" then
			local key, value = string.match(line, "^([%w_]+)%s*=%s*(.-)$")
			value = value and string.gsub(value, '^"(.*)"$', "%1")
			if not key then
				return fail(string.format("bad line %d in %s", lineno, source), "expected key = value",
					"fix the file or regenerate it with rgpu-admin slurm-config", "config")
			end
			local default = rgpu.DEFAULTS[key]
			if default == nil then
				return fail(string.format("unknown key %s in %s", key, source), "line " .. lineno,
					"remove it or regenerate the file with rgpu-admin slurm-config", "config")
			end
			if type(default) == "number" then
				if not string.match(value, "^%d+$") then
					return fail(string.format("%s = %s in %s is not a whole number", key, shown(value), source),
						"line " .. lineno, "fix the value", "config")
				end
				conf[key] = tonumber(value)
			else
				if not string.match(value, "^[%w_.-]+$") then
					return fail(string.format("%s = %s in %s is not a name", key, shown(value), source),
						"line " .. lineno, "fix the value", "config")
				end
				conf[key] = value
			end
		end
	end
	if conf.max_per_node < 1 or conf.max_per_job < 1 then
		return fail("max_per_node and max_per_job must be at least 1 in " .. source, "a job needs one slice",
			"fix the values", "config")
	end
	return conf
end

function rgpu.script_dir()
	local source = debug.getinfo(1, "S").source or ""
	local dir = string.match(source, "^@(.*/)[^/]*$")
	return dir or "./"
end

-- Read the config file; a missing file means defaults.
function rgpu.load_conf(path)
	local f = io.open(path, "r")
	if not f then
		return rgpu.parse_conf("", path)
	end
	local text = f:read("*a")
	f:close()
	return rgpu.parse_conf(text, path)
end

-- ---------------------------------------------------------------- parsing

-- Slices per node from tres_per_node, or nil when rgpu is not asked for. Returns count, err.
function rgpu.parse_tres_per_node(tres, gres_name)
	local found = nil
	for entry in string.gmatch(tres or "", "[^,]+") do
		entry = trim(entry)
		local rest = string.match(entry, "^gres[:/](.*)$")
		if rest then
			local name, tail = string.match(rest, "^([^:]+)(.*)$")
			if name == gres_name then
				if found then
					return fail("--gres names " .. gres_name .. " twice", "tres_per_node is " .. shown(tres),
						"give --gres=" .. gres_name .. ":N once")
				end
				if tail == "" then
					found = 1
				else
					local digits = string.match(tail, "^:(%d+)$")
					if not digits then
						return fail("invalid --gres=" .. shown(rest),
							gres_name .. " has no types and its count is a whole number",
							"write --gres=" .. gres_name .. ":N")
					end
					found = tonumber(digits)
				end
			end
		end
	end
	return found
end

local function parse_number(text)
	if string.match(text, "^%d+$") or string.match(text, "^%d+%.%d*$") or string.match(text, "^%.%d+$") then
		return tonumber(text)
	end
	return nil
end

function rgpu.parse_fraction(text)
	local value = parse_number(text)
	if value == nil then
		return fail("invalid fraction " .. shown(text), "not a number", "write e.g. --comment=fraction=0.5", "comment")
	end
	if not (value > 0 and value <= 1) then
		return fail("invalid fraction " .. shown(text), "it must be more than 0 and at most 1",
			"write e.g. --comment=fraction=0.5", "comment")
	end
	local hundredths = math.floor(rgpu.UNITS_PER_GPU * value + 0.5)
	if value < 0.005 then
		return fail("invalid fraction " .. shown(text), "the smallest slice is 0.01 of a GPU",
			"ask for fraction=0.01 or more", "comment")
	end
	-- Read from the text, not the float: digits past the second decimal must be zeros, or the
	-- slice granted would differ from the one asked for.
	local decimals = string.match(text, "%.(%d*)$") or ""
	if string.find(string.sub(decimals, 3), "[^0]") then
		return fail("invalid fraction " .. shown(text), "slices are whole hundredths of a GPU",
			"write fraction=" .. rgpu.format_hundredths(math.max(1, hundredths)), "comment")
	end
	return value
end

-- 33 -> "0.33", 100 -> "1", 50 -> "0.5".
function rgpu.format_hundredths(n)
	if n >= rgpu.UNITS_PER_GPU then
		return "1"
	end
	return (string.gsub(string.format("0.%02d", n), "0$", ""))
end

rgpu.MAX_BYTES = 2 ^ 60   -- rgpu.units.MAX_BYTES
rgpu.MAX_DIGITS = 40      -- rgpu.units._MAX_DIGITS

-- Sizes as rgpu.units.parse_size reads them: 8, 8G, 1.5T, .5G, 8.G, optional B or iB, any case.
function rgpu.parse_memory(text)
	local number, suffix, tail = string.match(text, "^([%d.]+)([KkMmGgTt]?)(.*)$")
	local value = number and #number <= rgpu.MAX_DIGITS and parse_number(number)
	if not value or not (tail == "" or string.match(tail, "^[iI]?[bB]$")) then
		return fail("invalid memory " .. shown(text), "not a size", "write e.g. --comment=memory=8G", "comment")
	end
	local bytes = math.floor(value * SIZE_MULT[string.upper(suffix)])
	if bytes <= 0 or bytes > rgpu.MAX_BYTES then
		return fail("invalid memory " .. shown(text), "it must be more than 0 and at most 1 EiB",
			"write e.g. --comment=memory=8G", "comment")
	end
	return bytes
end

-- As rgpu.units.format_bytes: "8.0 GiB", never in scientific notation.
function rgpu.format_bytes(value)
	for _, unit in ipairs({ { "EiB", 2 ^ 60 }, { "PiB", 2 ^ 50 }, { "TiB", 2 ^ 40 }, { "GiB", 2 ^ 30 },
		{ "MiB", 2 ^ 20 }, { "KiB", 2 ^ 10 } }) do
		if value >= unit[2] then
			return string.format("%.1f %s", value / unit[2], unit[1])
		end
	end
	return string.format("%.0f B", value)
end

-- A comment word whose one allowed value is `choice` (isolation=strict, pack=node), given once:
-- returns choice, or nil and the error.
local function the_one_choice(comment, key, value, seen, choice, why)
	if seen then
		return fail(key .. " is given twice", "comment is " .. shown(comment), "give " .. key .. "=" .. choice .. " once",
			"comment")
	end
	if string.lower(value) ~= choice then
		return fail("invalid " .. key .. " " .. shown(value), why,
			"write --comment=" .. key .. "=" .. choice .. ", or leave it out", "comment")
	end
	return choice
end

-- {fraction=F} or {memory_bytes=B} from the comment; returns req, err.
function rgpu.parse_comment(comment)
	comment = comment or ""
	-- Refuse rather than neutralise: the comment reaches prolog environments and logs, and a
	-- user who typed a quote or a newline made a mistake we should show, not hide.
	if string.find(comment, "[^%w .,_=:/+@-]") then
		return fail("the job comment holds characters rgpu does not accept",
			"only letters, digits, space and . , _ = : / + @ - are allowed in the comment of an rgpu job",
			"write e.g. --comment=fraction=0.5", "comment")
	end
	local fraction, memory, isolation, pack, err
	for word in string.gmatch(comment, "[^ ,]+") do
		local key, value = string.match(word, "^([^=]*)=(.*)$")
		key = key and string.lower(key)
		local bare = string.lower(string.gsub(word, "=", ""))
		if (key == nil or key == "") and (bare == "fraction" or bare == "memory" or bare == "isolation" or bare == "pack") then
			-- "fraction = 0.5" would otherwise silently mean a whole GPU.
			return fail("the comment names " .. bare .. " without its value", "comment is " .. shown(comment),
				"write " .. bare .. "=VALUE as one word, e.g. --comment=fraction=0.5", "comment")
		end
		if key == "fraction" then
			if fraction then
				return fail("fraction is given twice", "comment is " .. shown(comment), "give fraction=F once", "comment")
			end
			fraction, err = rgpu.parse_fraction(value)
			if not fraction then
				return nil, err
			end
		elseif key == "isolation" then
			isolation, err = the_one_choice(comment, key, value, isolation, "strict",
				"the one level is strict (only GPUs no other job's fault can reach)")
			if not isolation then
				return nil, err
			end
		elseif key == "pack" then
			pack, err = the_one_choice(comment, key, value, pack, "node",
				"the one packing is node (each node's slices on one GPU server, so NCCL stays on its NVLink or PCIe)")
			if not pack then
				return nil, err
			end
		elseif key == "memory" then
			if memory then
				return fail("memory is given twice", "comment is " .. shown(comment), "give memory=SIZE once", "comment")
			end
			memory, err = rgpu.parse_memory(value)
			if not memory then
				return nil, err
			end
		end
	end
	if fraction and memory then
		return fail("both fraction and memory are given", "a slice is sized by one of them",
			"give either fraction=F or memory=SIZE", "comment")
	end
	if memory then
		return { memory_bytes = memory, isolation = isolation, pack = pack, sized = true }
	end
	return { fraction = fraction or 1.0, isolation = isolation, pack = pack, sized = fraction ~= nil }
end

-- The comment an rgpu job keeps: the user's, plus "fraction=1" when it names no size. Every rgpu
-- job's comment then holds a fraction= or memory= word, which is how the node Prolog (told
-- neither licenses nor GRES by Slurm) passes over other jobs without asking the pool
-- (comment_may_ask_rgpu in slurm_plugin/jobenv.py).
function rgpu.normalized_comment(comment, req)
	if req.sized then
		return comment
	end
	comment = trim(comment or "")
	if comment == "" then
		return "fraction=1"
	end
	return comment .. " fraction=1"
end

-- The normalised request, recorded in the job's admin comment (only Slurm and admins write it).
-- PrologSlurmctld leases exactly this; its grammar is parse_record in slurm_plugin/request.py.
rgpu.RECORD_PREFIX = "rgpu:v1 "

function rgpu.record(plan)
	local size
	if plan.memory_bytes then
		size = string.format("memory=%.0f", plan.memory_bytes)
	else
		size = string.format("percent=%d", plan.per_slice)
	end
	local isolation = ""
	if plan.isolation then
		isolation = " isolation=" .. plan.isolation
	end
	local pack = ""
	if plan.pack then
		pack = " pack=" .. plan.pack
	end
	return string.format("%snodes=%d count=%d %s units=%d%s%s", rgpu.RECORD_PREFIX, plan.nodes, plan.count, size,
		plan.units, isolation, pack)
end

function rgpu.is_record(text)
	return text ~= nil and string.sub(text, 1, #rgpu.RECORD_PREFIX - 1) == string.sub(rgpu.RECORD_PREFIX, 1, -2)
end

-- The admin comment is "<record>" or "<record> | <rgpu's note>" (RECORD_SEPARATOR in request.py).
rgpu.RECORD_SEPARATOR = " | "

-- The record and the note ("" when there is none) of an admin comment.
function rgpu.split_admin_comment(text)
	local at = string.find(text or "", rgpu.RECORD_SEPARATOR, 1, true)
	if not at then
		return text, ""
	end
	return string.sub(text, 1, at - 1), string.sub(text, at)
end

-- The mark of a job held until the pool can place it (WAITING_MARK in request.py).
rgpu.ADMISSION_NOTE = rgpu.RECORD_SEPARATOR .. "rgpu: waiting: held until the pool can place its slices "
	.. "(rgpu-poold releases the job then)"

-- What a new rgpu job gets: its admin comment, and whether it is submitted held. With
-- hold_until_placed, a job whose priority nobody set is held and marked; rgpu-poold releases it
-- once the pool can place its slices (slurm_plugin/waiting.py), so Slurm never starts a job the
-- pool would refuse. Slurm counts a hold set here as the user's own (reason JobHeldUser; a
-- priority of 0 from job_submit is never an admin hold, 22.05 to 26.05), so slurm_job_modify
-- refuses the user's release of a marked job (rgpu.check_release). A job submitted with --hold
-- or a priority keeps it and is not marked: its release is its owner's.
function rgpu.admission(plan, conf, priority)
	if conf.hold_until_placed == 1 and (priority == nil or priority == rgpu.NO_VAL) then
		return plan.record .. rgpu.ADMISSION_NOTE, true
	end
	return plan.record, false
end

-- Whether an admin comment carries rgpu's waiting mark (WAITING_MARK, QUOTA_MARK in waiting.py).
function rgpu.is_waiting(admin_comment)
	local record, note = rgpu.split_admin_comment(admin_comment)
	local mark = rgpu.RECORD_SEPARATOR .. "rgpu: waiting"
	return rgpu.is_record(record) and string.sub(note, 1, #mark) == mark
end

-- `scontrol release` reaches job_modify as priority INFINITE, `scontrol update priority=N` as N,
-- a hold as 0 (22.05 to 26.05). Releasing a held job that carries rgpu's waiting mark is the
-- pool's alone (root, SlurmUser, or release_uid: how rgpu-poold's scontrol runs): the user's own
-- release would start the job before the pool's placement check. Holds pass; so do changes of
-- jobs that are not held (Slurm allows a user no more than to lower his job's priority).
function rgpu.check_release(job_id, desc_priority, rec_priority, admin_comment, privileged)
	if privileged or desc_priority == nil or desc_priority == 0 or desc_priority == rgpu.NO_VAL
		or rec_priority ~= 0 or not rgpu.is_waiting(admin_comment) then
		return true
	end
	local id = tostring(job_id)
	return fail("job " .. id .. " is held until the pool can place its slices, and only rgpu-poold releases it",
		"a release by its user would start it before the pool's placement check",
		"wait: rgpu-poold releases it once its slices fit; `scontrol show job " .. id
		.. "` (AdminComment) says why it waits, `rgpu-admin list-gpus` shows the pool's room", "access")
end

-- The uid slurmctld runs as (SlurmUser): job_submit.lua runs inside it. nil where /proc is not
-- readable (then root and release_uid alone may release rgpu's held jobs).
function rgpu.own_uid()
	local f = io.open("/proc/self/status", "r")
	if not f then
		return nil
	end
	local text = f:read("*a")
	f:close()
	return tonumber(string.match(text, "\nUid:%s*(%d+)"))
end

function rgpu.may_release(uid, conf)
	return uid == 0 or uid == rgpu.own_uid() or (conf.release_uid > 0 and uid == conf.release_uid)
end

function rgpu.units_per_slice(req, conf)
	if req.memory_bytes then
		if conf.gpu_memory_bytes <= 0 then
			return rgpu.UNITS_PER_GPU
		end
		return math.ceil(rgpu.UNITS_PER_GPU * req.memory_bytes / conf.gpu_memory_bytes)
	end
	return math.floor(rgpu.UNITS_PER_GPU * req.fraction + 0.5)
end

-- Whether the pool's GPUs (as job_submit_rgpu.conf describes them) could ever hold `count` slices
-- of `per_slice` units on one node (each on a distinct GPU): isolation=strict needs GPUs shared
-- isolated (or exclusive, for whole GPUs); a fractional slice cannot go on an exclusive GPU.
-- A request that fails here would wait for ever, so it is refused at submission.
function rgpu.check_capabilities(count, per_slice, isolation, conf)
	if conf.pool_gpus <= 0 then
		return true
	end
	local whole = per_slice >= rgpu.UNITS_PER_GPU
	local usable, what
	if isolation == "strict" then
		usable = conf.isolated_gpus + (whole and conf.exclusive_gpus or 0)
		what = whole and "shared isolated or exclusive" or "shared isolated (fractional strict slices)"
	else
		usable = conf.pool_gpus - (whole and 0 or conf.exclusive_gpus)
		what = whole and "in the pool" or "that take fractional slices (not exclusive)"
	end
	if count <= usable then
		return true
	end
	local asked = string.format("%d slice(s) per node%s", count, isolation == "strict" and " with isolation=strict" or "")
	local fix
	if usable == 0 and isolation == "strict" then
		fix = "leave isolation=strict out, or ask the admin for GPUs with gpu_sharing = isolated"
	elseif usable == 0 then
		fix = "ask for whole GPUs (fraction=1)"
	else
		fix = string.format("ask for at most %d slice(s) per node", usable)
	end
	return fail("no GPU of the pool can ever serve " .. asked,
		string.format("the pool has %d GPU(s) %s, and one node's slices are on distinct GPUs", usable, what), fix, "pool")
end

-- Licenses without the rgpu entry; err when the user asked for the rgpu license himself.
function rgpu.other_licenses(licenses, license_name, user_given)
	local kept = {}
	for entry in string.gmatch(licenses or "", "[^,]+") do
		local name = string.match(trim(entry), "^([^:*]+)")
		if name == license_name then
			if user_given then
				return fail("do not ask for the " .. license_name .. " license yourself",
					"rgpu sets it from --gres=" .. license_name .. ":N and the comment",
					"remove " .. license_name .. " from -L/--licenses", "license")
			end
		elseif trim(entry) ~= "" then
			kept[#kept + 1] = trim(entry)
		end
	end
	return kept
end

-- The whole decision for one request. `job` holds tres_per_node, comment, min_nodes,
-- max_nodes, licenses (the user's), licenses_user_given. Returns
-- {rgpu=false} for a job without rgpu, {rgpu=true, nodes, count, units, licenses} or nil, err.
function rgpu.plan(job, conf)
	for _, field in ipairs({ "tres_per_job", "tres_per_task", "tres_per_socket" }) do
		local count, err = rgpu.parse_tres_per_node(job[field], conf.gres_name)
		if count or err then
			return fail(conf.gres_name .. " is asked per " .. string.gsub(field, "tres_per_", ""),
				"rgpu slices are given per node", "use --gres=" .. conf.gres_name .. ":N")
		end
	end
	local count, err = rgpu.parse_tres_per_node(job.tres_per_node, conf.gres_name)
	if err then
		return nil, err
	end
	if count == nil then
		local others, lerr = rgpu.other_licenses(job.licenses, conf.license_name, job.licenses_user_given)
		if not others then
			return nil, lerr
		end
		return { rgpu = false }
	end
	if job.het_job_offset ~= nil and job.het_job_offset < rgpu.NO_VAL then
		-- Slurm starts each component's tasks with the leader's job id, so they would find the
		-- leader's slices (one host) or none (another host), not their own component's.
		return fail("a heterogeneous job cannot ask for " .. conf.gres_name,
			"rgpu gives each job's slices to its tasks by job id, and Slurm gives every component's tasks the leader's",
			"submit each component that needs " .. conf.gres_name .. " as a job of its own (e.g. chained with --dependency)",
			"gres")
	end
	if count < 1 or count > conf.max_per_node then
		return fail("invalid --gres=" .. conf.gres_name .. ":" .. count,
			"the count of slices per node must be from 1 to " .. conf.max_per_node,
			"ask for 1 to " .. conf.max_per_node .. " slices")
	end
	local req
	req, err = rgpu.parse_comment(job.comment)
	if not req then
		return nil, err
	end
	local nodes = 1
	if is_set(job.min_nodes) then
		nodes = job.min_nodes
	end
	if is_set(job.max_nodes) and job.max_nodes ~= nodes then
		return fail("a variable node count is not supported with --gres=" .. conf.gres_name,
			"rgpu must know how many slices to reserve at submit time",
			"give a fixed count such as -N " .. nodes, "nodes")
	end
	if nodes * count > conf.max_per_job then
		return fail(string.format("%d nodes x %d slices is more than %d slices per job", nodes, count, conf.max_per_job),
			"the configured maximum", "ask for fewer nodes or slices", "nodes")
	end
	local per_slice = rgpu.units_per_slice(req, conf)
	if per_slice > rgpu.UNITS_PER_GPU then
		return fail("memory=" .. rgpu.format_bytes(req.memory_bytes) .. " per slice is more than one GPU holds",
			"the smallest GPU in the pool has " .. rgpu.format_bytes(conf.gpu_memory_bytes) .. " usable",
			"ask for less memory per slice, or for more slices", "comment")
	end
	local cerr = select(2, rgpu.check_capabilities(count, per_slice, req.isolation, conf))
	if cerr then
		return nil, cerr
	end
	local others, lerr = rgpu.other_licenses(job.licenses, conf.license_name, job.licenses_user_given)
	if not others then
		return nil, lerr
	end
	local units = nodes * count * per_slice
	others[#others + 1] = conf.license_name .. ":" .. units
	local plan = {
		rgpu = true, nodes = nodes, count = count, units = units, per_slice = per_slice,
		fraction = req.fraction, memory_bytes = req.memory_bytes, licenses = table.concat(others, ","),
		isolation = req.isolation, pack = req.pack, comment = rgpu.normalized_comment(job.comment, req),
	}
	plan.record = rgpu.record(plan)
	return plan
end

-- The plan for `scontrol update` of an existing job: desc holds only what changes (nil or
-- NO_VAL otherwise), rec is the job as it is. Returns {change=false}, {change=true, plan} or nil, err.
--
-- Only an admin (uid 0) may change the rgpu request of a pending job: the new request is
-- recorded in the admin comment, which Slurm lets no one else write (a user's update that set it
-- would be refused after Slurm had applied part of it).
function rgpu.plan_modify(desc, rec, conf, is_admin)
	local touches = desc.tres_per_node ~= nil or desc.comment ~= nil or desc.licenses ~= nil
		or is_set(desc.min_nodes) or is_set(desc.max_nodes)
	if not touches then
		return { change = false }
	end
	local old_count = rgpu.parse_tres_per_node(rec.tres_per_node, conf.gres_name)
	local new_tres = desc.tres_per_node
	if new_tres == nil then
		new_tres = rec.tres_per_node
	end
	local min_nodes = is_set(desc.min_nodes) and desc.min_nodes or rec.min_nodes
	local max_nodes = is_set(desc.max_nodes) and desc.max_nodes or rec.max_nodes
	if is_set(desc.min_nodes) and not is_set(desc.max_nodes) then
		max_nodes = desc.min_nodes   -- "numnodes=2" sets both ends
	end
	local user_licenses = desc.licenses ~= nil
	local plan, err = rgpu.plan({
		tres_per_node = new_tres,
		comment = desc.comment ~= nil and desc.comment or rec.comment,
		min_nodes = min_nodes, max_nodes = max_nodes,
		licenses = user_licenses and desc.licenses or rec.licenses,
		licenses_user_given = user_licenses,
		-- A component of a heterogeneous job (het_job_id set) is refused as at submission.
		het_job_offset = (rec.het_job_id or 0) > 0 and (rec.het_job_offset or 0) or nil,
	}, conf)
	if not plan then
		return nil, err
	end
	if not plan.rgpu then
		if old_count then
			return fail("removing " .. conf.gres_name .. " from a job is not supported",
				"its license is set from the rgpu request", "scancel the job and submit it again")
		end
		return { change = false }
	end
	-- The low byte is the base state (JOB_PENDING = 0); higher bits are flags such as REQUEUE.
	local pending = rec.job_state ~= nil and math.fmod(rec.job_state, 256) == 0
	if not pending then
		local old_plan = rgpu.plan({ tres_per_node = rec.tres_per_node, comment = rec.comment,
			min_nodes = rec.min_nodes, max_nodes = rec.max_nodes, licenses = rec.licenses }, conf)
		if not old_plan or old_plan.units ~= plan.units or old_plan.count ~= plan.count
			or desc.tres_per_node ~= nil or user_licenses then
			return fail("the rgpu request of a job that is not pending cannot change",
				"its slices are already allocated", "scancel the job and submit it again", "access")
		end
		return { change = false, comment = plan.comment }
	end
	local old_record, note = rgpu.split_admin_comment(rec.admin_comment)
	local record_changed = plan.record ~= old_record
	if record_changed and not is_admin then
		return fail("only an admin can change the rgpu request of a submitted job",
			"the request is recorded where only Slurm and admins write",
			"scancel the job and submit it again, or ask an admin to run the scontrol update", "access")
	end
	-- rgpu's note stays (a job held until the pool can place it is still released by rgpu-poold).
	return { change = true, plan = plan, record_changed = record_changed, comment = plan.comment,
		admin_comment = plan.record .. note }
end

-- ---------------------------------------------------------------- Slurm entry points

local function conf_or_err()
	return rgpu.load_conf(rgpu.script_dir() .. rgpu.CONF_NAME)
end

local function involves_rgpu(text)
	return text ~= nil and string.find(text, "rgpu", 1, true) ~= nil
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	rgpu.kinds = {}
	local conf, err = conf_or_err()
	if not conf then
		if involves_rgpu(job_desc.tres_per_node) or involves_rgpu(job_desc.licenses) then
			slurm.log_error("%s", err)
			slurm.log_user("%s", err)
			return slurm.ERROR
		end
		return slurm.SUCCESS
	end
	local plan
	plan, err = rgpu.plan({
		tres_per_node = job_desc.tres_per_node, tres_per_job = job_desc.tres_per_job,
		tres_per_task = job_desc.tres_per_task, tres_per_socket = job_desc.tres_per_socket,
		comment = job_desc.comment, min_nodes = job_desc.min_nodes, max_nodes = job_desc.max_nodes,
		licenses = job_desc.licenses, licenses_user_given = true, het_job_offset = job_desc.het_job_offset,
	}, conf)
	if not plan then
		slurm.log_info("rgpu: refused a job of uid %s: %s", tostring(submit_uid), err)
		slurm.log_user("%s", err)
		return rgpu.error_code(err)
	end
	if plan.rgpu then
		job_desc.min_nodes = plan.nodes
		job_desc.max_nodes = plan.nodes
		job_desc.licenses = plan.licenses
		local hold
		job_desc.admin_comment, hold = rgpu.admission(plan, conf, job_desc.priority)
		if hold then
			job_desc.priority = 0
		end
		if plan.comment ~= job_desc.comment then
			job_desc.comment = plan.comment
		end
	elseif rgpu.is_record(job_desc.admin_comment) and submit_uid ~= 0 then
		err = select(2, fail("the admin comment holds an rgpu request record", "only job_submit.lua writes it",
			"remove the admin comment", "access"))
		slurm.log_info("rgpu: refused a job of uid %s: %s", tostring(submit_uid), err)
		slurm.log_user("%s", err)
		return rgpu.error_code(err)
	end
	return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	rgpu.kinds = {}
	local conf, err = conf_or_err()
	if not conf then
		if involves_rgpu(job_rec.tres_per_node) or involves_rgpu(job_desc.tres_per_node) then
			slurm.log_error("%s", err)
			return slurm.ERROR
		end
		return slurm.SUCCESS
	end
	local ok
	ok, err = rgpu.check_release(job_rec.job_id, job_desc.priority, job_rec.priority, job_rec.admin_comment,
		rgpu.may_release(modify_uid, conf))
	if not ok then
		slurm.log_info("rgpu: refused a release of job %s by uid %s (priority=%s): %s", tostring(job_rec.job_id),
			tostring(modify_uid), tostring(job_desc.priority), err)
		slurm.log_user("%s", err)
		return rgpu.error_code(err)
	end
	local result
	result, err = rgpu.plan_modify({
		tres_per_node = job_desc.tres_per_node, comment = job_desc.comment, licenses = job_desc.licenses,
		min_nodes = job_desc.min_nodes, max_nodes = job_desc.max_nodes,
	}, {
		tres_per_node = job_rec.tres_per_node, comment = job_rec.comment, licenses = job_rec.licenses,
		min_nodes = job_rec.min_nodes, max_nodes = job_rec.max_nodes, job_state = job_rec.job_state,
		admin_comment = job_rec.admin_comment, het_job_id = job_rec.het_job_id, het_job_offset = job_rec.het_job_offset,
	}, conf, modify_uid == 0)
	if not result then
		-- Slurm 22.05 does not show log_user text for updates (fixed in 23.02): the log has it.
		slurm.log_info("rgpu: refused an update of job %s by uid %s: %s", tostring(job_rec.job_id),
			tostring(modify_uid), err)
		slurm.log_user("%s", err)
		return rgpu.error_code(err)
	end
	if job_desc.comment ~= nil and result.comment ~= nil and result.comment ~= job_desc.comment then
		job_desc.comment = result.comment     -- an rgpu job's comment keeps its size word
	end
	if result.change then
		job_desc.min_nodes = result.plan.nodes
		job_desc.max_nodes = result.plan.nodes
		job_desc.licenses = result.plan.licenses
		if result.record_changed then
			job_desc.admin_comment = result.admin_comment
		end
	end
	return slurm.SUCCESS
end

-- Exposed for the unit tests, which load this file with dofile() in the standalone interpreter.
-- (No `return`: Slurm treats a non-zero value returned by the script as a load failure.)
rgpu_job_submit = rgpu
