-- include: now reserve quota stats prefix
-- settle: one decision's outcome or undo, in one call. KEYS: inflight, held, due, expired. ARGV[1]
-- the key prefix, [2] reservation id, [3] release its pool (0/1), [4] the outcome's pool ('': no
-- outcome), [5] the statistics' alpha, [6] ttft ms or '', [7] duration ms or '', [8] failed 0/1,
-- [9] its quota: '' nothing, 's' settle with [10] tokens and [11] usd ('' each: as reserved), 'u'
-- undo; [12] cached tokens reported ('': none), [13] the retention's alpha; [14] the tenant whose
-- fairness counter changes ('': none), [15] by how much (xroute.admission_rules.correction).
-- {the pool released or '', quota settled or undone 0/1, the pool whose retention learned or ''}
local rid = ARGV[2]
local released = ''
if ARGV[3] == '1' then released = release_held(rid) or '' end
if ARGV[4] ~= '' then observe(base .. 'stats:' .. ARGV[4], tonumber(ARGV[5]), ARGV[6], ARGV[7], tonumber(ARGV[8])) end
local q = 0
if ARGV[9] == 's' then
  q = settle(base .. 'qr:' .. rid, rid, ARGV[10], ARGV[11])
elseif ARGV[9] == 'u' then
  q = unbook(base .. 'qr:' .. rid, rid)
end
local learned = ''
if ARGV[12] ~= '' then learned = retention(rid, ARGV[12], ARGV[13]) or '' end
if ARGV[14] ~= '' then redis.call('HINCRBYFLOAT', base .. 'fair', ARGV[14], ARGV[15]) end
return {released, q, learned}
