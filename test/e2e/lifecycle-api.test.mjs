// e2b SDK compatibility of issue 17's API: metrics over time (getMetrics
// with start/end), lifecycle.autoResume (traffic resumes a paused
// sandbox), and the SDK's error classes for a paused sandbox and for a
// sandbox killed during commands.run. Run by e2e_test.go against
// `space up` (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY).
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { Sandbox, SandboxNotFoundError, TimeoutError } from 'e2b'

for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[v]) throw new Error(`${v} must be set (run through go test ./test/e2e)`)
}

const run = randomBytes(4).toString('hex')
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const created = []
async function create(opts = {}) {
  const sbx = await Sandbox.create('base', { timeoutMs: 180_000, ...opts, metadata: { run, ...(opts.metadata ?? {}) } })
  created.push(sbx)
  return sbx
}
after(async () => {
  await Promise.all(created.map((s) => s.kill().catch(() => {})))
})

test('getMetrics with start/end: a series of samples 5 s apart, oldest first, CPU of a busy loop', async () => {
  const sbx = await create()
  await sbx.commands.run('while :; do :; done', { background: true })
  const start = new Date()
  await sleep(16_000)
  const end = new Date()
  const ms = await sbx.getMetrics({ start, end })
  assert.ok(ms.length >= 3, `${ms.length} samples in 16 s: ${JSON.stringify(ms)}`)
  for (const [i, m] of ms.entries()) {
    assert.ok(m.timestamp instanceof Date)
    assert.ok(m.timestamp.getTime() >= Math.floor(start.getTime() / 1000) * 1000 && m.timestamp.getTime() < end.getTime() + 1000,
      `sample ${i} at ${m.timestamp.toISOString()} outside [${start.toISOString()}, ${end.toISOString()}]`)
    if (i > 0) assert.ok(m.timestamp > ms[i - 1].timestamp, 'oldest first')
    assert.ok(m.cpuUsedPct > 0, `sample ${i}: cpuUsedPct ${m.cpuUsedPct}`)
    assert.ok(m.memUsed > 0 && m.memTotal >= m.memUsed && m.cpuCount >= 1 && m.diskTotal >= m.diskUsed)
  }
  // The first sample already carries a real CPU delta.
  assert.ok(ms[0].cpuUsedPct > 0)
  // A window in the past holds nothing; the static call is the same API.
  assert.deepEqual(await Sandbox.getMetrics(sbx.sandboxId, { start: new Date(start.getTime() - 3600_000), end: new Date(start.getTime() - 1800_000) }), [])
  const all = await Sandbox.getMetrics(sbx.sandboxId)
  assert.ok(all.length >= ms.length)
})

test('lifecycle.autoResume: traffic resumes a paused sandbox, and getInfo reports the lifecycle', async () => {
  const sbx = await create({ lifecycle: { onTimeout: 'pause', autoResume: true } })
  const info = await sbx.getInfo()
  assert.deepEqual(info.lifecycle, { onTimeout: 'pause', autoResume: true })
  await sbx.files.write('/home/user/note', 'before pause')
  await sbx.commands.run('echo started > /tmp/proc; sleep 600 >/dev/null 2>&1 &')
  await sbx.pause()
  assert.equal((await sbx.getInfo()).state, 'paused')
  // Concurrent requests of several kinds: one resume serves them all.
  const [read, ran, listed] = await Promise.all([
    sbx.files.read('/home/user/note'),
    sbx.commands.run('cat /tmp/proc'),
    sbx.files.list('/home/user'),
  ])
  assert.equal(read, 'before pause')
  assert.equal(ran.stdout, 'started\n')
  assert.ok(listed.some((e) => e.name === 'note'))
  assert.equal((await sbx.getInfo()).state, 'running')
  assert.equal(await sbx.isRunning(), true)
})

test('paused sandbox without autoResume: isRunning false, commands.run SandboxNotFoundError, files TimeoutError (E2B proxy 502)', async () => {
  const sbx = await create()
  assert.equal((await sbx.getInfo()).lifecycle.autoResume, false)
  await sbx.files.write('/home/user/note', 'x')
  await sbx.pause()
  assert.equal(await sbx.isRunning(), false)
  await assert.rejects(sbx.commands.run('echo hi'), SandboxNotFoundError)
  await assert.rejects(sbx.files.read('/home/user/note'), TimeoutError)
  assert.equal((await sbx.getInfo()).state, 'paused')
})

test('killed during commands.run: TimeoutError "killed or reached its end of life"', async () => {
  const sbx = await create()
  const outcome = sbx.commands.run('sleep 60').then((r) => r, (err) => err)
  await sleep(1500)
  await Sandbox.kill(sbx.sandboxId)
  const err = await outcome
  assert.ok(err instanceof TimeoutError, `${err?.constructor?.name}: ${err?.message}`)
  assert.match(err.message, /The sandbox was killed or reached its end of life while the request was in flight/)
  assert.doesNotMatch(err.message, /execution replaced/)
})
