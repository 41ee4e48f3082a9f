// e2b SDK compatibility: the Sandbox, Commands and PTY surface. One test per
// SDK call, each asserting what the call returned or did. Run by
// e2e_test.go against `space up` (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY).
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { Sandbox, SandboxError, CommandExitError, TimeoutError, NotFoundError } from 'e2b'

for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[v]) throw new Error(`${v} must be set (run through go test ./test/e2e)`)
}

const run = randomBytes(4).toString('hex') // tags this run's sandboxes in metadata
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const created = []
async function create(opts = {}) {
  const sbx = await Sandbox.create('base', { timeoutMs: 120_000, ...opts, metadata: { run, ...(opts.metadata ?? {}) } })
  created.push(sbx)
  return sbx
}
// until polls fn until it returns a truthy value (or fails after ms).
async function until(fn, ms = 5000, what = 'condition') {
  const end = Date.now() + ms
  for (;;) {
    const v = await fn()
    if (v) return v
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`)
    await sleep(50)
  }
}

let sbx // shared sandbox for the commands and PTY tests
before(async () => {
  sbx = await create({ envs: { SBX_LEVEL: 'from-create' } })
})
after(async () => {
  await Promise.all(created.map((s) => s.kill().catch(() => {})))
})

// ---------------------------------------------------------------- Sandbox

test('Sandbox.create: template, timeoutMs, metadata, envs', async () => {
  const t0 = Date.now()
  const s = await create({ timeoutMs: 90_000, metadata: { role: 'create' }, envs: { GREETING: 'hola' } })
  assert.match(s.sandboxId, /^[a-z0-9]+$/)
  const info = await s.getInfo()
  assert.equal(info.templateId, 'base')
  assert.deepEqual(info.metadata, { run, role: 'create' })
  const ttl = info.endAt.getTime() - t0
  assert.ok(ttl > 80_000 && ttl < 100_000, `endAt ${ttl}ms after create, want ~90s`)
  const r = await s.commands.run('echo $GREETING')
  assert.equal(r.stdout, 'hola\n')
})

test('Sandbox.create secure: envd requires the access token', async () => {
  assert.ok(sbx.envdAccessToken, 'create returns an envd access token')
  const url = `${process.env.E2B_SANDBOX_URL}/files?path=/etc/hostname`
  const headers = { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983' }
  const without = await fetch(url, { headers })
  assert.equal(without.status, 401)
  const wrong = await fetch(url, { headers: { ...headers, 'X-Access-Token': 'x'.repeat(32) } })
  assert.equal(wrong.status, 401)
  const withTok = await fetch(url, { headers: { ...headers, 'X-Access-Token': sbx.envdAccessToken } })
  assert.equal(withTok.status, 200)
})

test('Sandbox.connect to a running sandbox', async () => {
  await sbx.files.write('/tmp/connect-marker', 'marker')
  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal(again.sandboxId, sbx.sandboxId)
  assert.equal(await again.files.read('/tmp/connect-marker'), 'marker')
  await assert.rejects(Sandbox.connect('nosuchsandbox000000'), (e) => e instanceof NotFoundError)
})

test('Sandbox.list: metadata and state filters, pagination', async () => {
  const tag = randomBytes(3).toString('hex')
  const a = await create({ metadata: { list: tag } })
  const b = await create({ metadata: { list: tag } })
  const p = Sandbox.list({ query: { metadata: { run, list: tag }, state: ['running'] }, limit: 1 })
  assert.equal(p.hasNext, true)
  const seen = []
  for (let i = 0; p.hasNext && i < 5; i++) {
    const items = await p.nextItems()
    assert.ok(items.length <= 1, `page of ${items.length} with limit 1`)
    seen.push(...items)
  }
  assert.equal(p.hasNext, false)
  assert.deepEqual(seen.map((x) => x.sandboxId).sort(), [a.sandboxId, b.sandboxId].sort())
  for (const x of seen) {
    assert.equal(x.state, 'running')
    assert.equal(x.templateId, 'base')
    assert.deepEqual(x.metadata, { run, list: tag })
    assert.ok(x.startedAt instanceof Date && !isNaN(x.startedAt))
    assert.ok(x.cpuCount > 0 && x.memoryMB > 0)
  }
  // State filter: nothing of these is paused.
  const paused = await Sandbox.list({ query: { metadata: { list: tag }, state: ['paused'] } }).nextItems()
  assert.deepEqual(paused, [])
  // A metadata value nobody has.
  const none = await Sandbox.list({ query: { metadata: { list: 'nobody-' + tag } } }).nextItems()
  assert.deepEqual(none, [])
})

test('Sandbox.getInfo fields', async () => {
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.templateId, 'base')
  assert.equal(info.state, 'running')
  assert.deepEqual(info.metadata, { run })
  assert.ok(info.startedAt instanceof Date && info.startedAt.getTime() <= Date.now())
  assert.ok(info.endAt > info.startedAt)
  assert.ok(info.cpuCount > 0 && info.memoryMB > 0)
  assert.match(info.envdVersion, /^\d+\.\d+\.\d+$/)
  const st = await Sandbox.getInfo(sbx.sandboxId)
  assert.equal(st.sandboxId, sbx.sandboxId)
})

test('Sandbox.setTimeout moves endAt', async () => {
  const s = await create({ timeoutMs: 60_000 })
  const t0 = Date.now()
  await s.setTimeout(300_000)
  let end = (await s.getInfo()).endAt.getTime() - t0
  assert.ok(end > 290_000 && end < 310_000, `endAt +${end}ms, want ~300s`)
  await Sandbox.setTimeout(s.sandboxId, 30_000)
  end = (await s.getInfo()).endAt.getTime() - t0
  assert.ok(end > 20_000 && end < 40_000, `endAt +${end}ms, want ~30s`)
})

test('Sandbox.setTimeout expiry kills the sandbox', async () => {
  const s = await create({ timeoutMs: 60_000 })
  await s.setTimeout(1_000)
  await until(async () => !(await s.isRunning()), 15_000, 'timeout kill')
  await until(() => s.getInfo().then(() => false, (e) => e instanceof NotFoundError), 5_000, 'getInfo NotFound')
})

test('Sandbox.isRunning and kill', async () => {
  const s = await create()
  assert.equal(await s.isRunning(), true)
  await s.kill()
  assert.equal(await s.isRunning(), false)
  await assert.rejects(s.getInfo(), (e) => e instanceof NotFoundError)
  assert.equal(await Sandbox.kill(s.sandboxId), false, 'killing it again reports false')
})

test('Sandbox.pause then connect resumes: files and processes kept', async () => {
  const s = await create({ metadata: { role: 'pause' } })
  await s.files.write('/home/user/kept.txt', 'kept across pause')
  const bg = await s.commands.run('sleep 600', { background: true })
  assert.equal(await s.pause(), true)
  assert.equal((await s.getInfo()).state, 'paused')
  // As on E2B, the proxy (our edge) answers 502 for a paused sandbox, so
  // isRunning() is false and envd calls raise the SDK's timeout error.
  assert.equal(await s.isRunning(), false)
  await assert.rejects(s.files.read('/home/user/kept.txt'), (e) => e instanceof TimeoutError && /paused/.test(e.message))
  const paused = await Sandbox.list({ query: { metadata: { run, role: 'pause' }, state: ['paused'] } }).nextItems()
  assert.deepEqual(paused.map((x) => x.sandboxId), [s.sandboxId])
  assert.equal(await Sandbox.pause(s.sandboxId), false, 'pausing a paused sandbox reports false')

  const r = await Sandbox.connect(s.sandboxId, { timeoutMs: 60_000 })
  assert.equal((await r.getInfo()).state, 'running')
  assert.equal(await r.files.read('/home/user/kept.txt'), 'kept across pause')
  const procs = await r.commands.list()
  assert.ok(procs.some((p) => p.pid === bg.pid), `pid ${bg.pid} in ${JSON.stringify(procs.map((p) => p.pid))}`)
})

test('Sandbox.getMetrics: cpu, memory, disk', async () => {
  await sbx.files.write('/home/user/metrics-fill', randomBytes(1 << 20))
  // Samples are taken every 5 s: wait for one taken after the write.
  const ms = await until(async () => {
    const m = await sbx.getMetrics()
    return m.length > 0 && m[m.length - 1].diskUsed >= 1 << 20 && m
  }, 15_000, 'a sample after the write')
  const m = ms[ms.length - 1]
  assert.ok(m.timestamp instanceof Date && Math.abs(m.timestamp - Date.now()) < 60_000)
  assert.ok(m.cpuCount >= 1, 'cpuCount')
  assert.ok(m.cpuUsedPct >= 0 && m.cpuUsedPct <= 100 * m.cpuCount, `cpuUsedPct ${m.cpuUsedPct}`)
  assert.ok(m.memUsed > 0 && m.memTotal >= m.memUsed, `mem ${m.memUsed}/${m.memTotal}`)
  assert.ok(m.diskUsed >= 1 << 20 && m.diskTotal >= m.diskUsed, `disk ${m.diskUsed}/${m.diskTotal}`)
  const st = await Sandbox.getMetrics(sbx.sandboxId)
  assert.ok(st.length > 0 && st[0].memTotal > 0 && st[0].memUsed > 0 && st[0].diskUsed > 0 && st[0].timestamp instanceof Date)
})

test('Sandbox.createSnapshot and Sandbox.create(snapshotId)', async () => {
  const s = await create()
  await s.files.write('/home/user/snap.txt', 'in the snapshot')
  const snap = await s.createSnapshot()
  assert.ok(snap.snapshotId, 'snapshot id')
  assert.equal(await s.isRunning(), true, 'the source keeps running')
  const c = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000, metadata: { run } })
  created.push(c)
  assert.notEqual(c.sandboxId, s.sandboxId)
  assert.equal(await c.files.read('/home/user/snap.txt'), 'in the snapshot')
  const listed = await Sandbox.listSnapshots({ sandboxId: s.sandboxId }).nextItems()
  assert.ok(listed.some((x) => x.snapshotId === snap.snapshotId))
})

test('Sandbox.deleteSnapshot: by id, then gone', async () => {
  const s = await create()
  const snap = await s.createSnapshot()
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  const listed = await Sandbox.listSnapshots({ sandboxId: s.sandboxId }).nextItems()
  assert.ok(!listed.some((x) => x.snapshotId === snap.snapshotId), 'deleted snapshot still listed')
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false, 'deleting it again reports false')
  await assert.rejects(Sandbox.create(snap.snapshotId, { metadata: { run } }), (e) => e instanceof NotFoundError || /not found/i.test(e.message))
})

test('Sandbox.fork: count sandboxes with the source files, source untouched', async () => {
  const s = await create()
  await s.files.write('/home/user/forked.txt', 'from the source')
  const forks = await Sandbox.fork(s.sandboxId, { count: 2, timeoutMs: 60_000 })
  assert.equal(forks.length, 2)
  for (const f of forks) {
    assert.ok(f instanceof Sandbox, `fork failed: ${f}`)
    created.push(f)
    assert.notEqual(f.sandboxId, s.sandboxId)
    assert.equal(await f.files.read('/home/user/forked.txt'), 'from the source')
    await f.files.write('/home/user/forked.txt', 'changed in ' + f.sandboxId)
  }
  assert.notEqual(forks[0].sandboxId, forks[1].sandboxId)
  assert.equal(await s.files.read('/home/user/forked.txt'), 'from the source', 'forks write their own copies')
  assert.equal((await s.getInfo()).state, 'running')
  await assert.rejects(Sandbox.fork('nosuchsandbox0000000'), (e) => e instanceof NotFoundError || /not found/i.test(e.message))
})

// ---------------------------------------------------------------- Commands

test('commands.run foreground: stdout, stderr, exitCode', async () => {
  const r = await sbx.commands.run('echo out; echo err >&2')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'out\n')
  assert.equal(r.stderr, 'err\n')
  assert.equal(r.error, undefined)
})

test('commands.run: CommandExitError carries the result', async () => {
  await assert.rejects(sbx.commands.run('echo partial; echo bad >&2; exit 7'), (e) => {
    assert.ok(e instanceof CommandExitError)
    assert.equal(e.exitCode, 7)
    assert.equal(e.stdout, 'partial\n')
    assert.equal(e.stderr, 'bad\n')
    return true
  })
})

test('commands.run onStdout/onStderr stream in order', async () => {
  const out = []
  const err = []
  await sbx.commands.run('for i in 1 2 3; do echo o$i; echo e$i >&2; done', {
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  })
  assert.equal(out.join(''), 'o1\no2\no3\n')
  assert.equal(err.join(''), 'e1\ne2\ne3\n')
})

test('commands.run envs: per-command and sandbox-level', async () => {
  const r = await sbx.commands.run('echo "$FOO $SBX_LEVEL"', { envs: { FOO: 'bar' } })
  assert.equal(r.stdout, 'bar from-create\n')
})

test('commands.run cwd', async () => {
  const r = await sbx.commands.run('pwd', { cwd: '/tmp' })
  assert.equal(r.stdout, '/tmp\n')
})

test('commands.run user', async () => {
  assert.equal((await sbx.commands.run('id -un', { user: 'root' })).stdout, 'root\n')
  assert.equal((await sbx.commands.run('id -un', { user: 'user' })).stdout, 'user\n')
  assert.equal((await sbx.commands.run('id -un')).stdout, 'user\n')
})

test('commands.run timeoutMs: TimeoutError and the process is killed', async () => {
  const marker = `/tmp/timeout-${randomBytes(3).toString('hex')}`
  await assert.rejects(
    sbx.commands.run(`sleep 30; touch ${marker}`, { timeoutMs: 1_000 }),
    (e) => e instanceof TimeoutError,
  )
  await until(async () => {
    const ps = await sbx.commands.list()
    return !ps.some((p) => p.args.join(' ').includes(marker))
  }, 5000, 'timed-out process to go')
})

test('commands.run background: handle, wait, list, kill', async () => {
  const h = await sbx.commands.run('echo started; sleep 600', { background: true })
  assert.ok(h.pid > 0)
  await until(() => h.stdout === 'started\n', 5000, 'background stdout')
  const ps = await sbx.commands.list()
  const p = ps.find((x) => x.pid === h.pid)
  assert.ok(p, 'listed')
  assert.equal(p.cmd, '/bin/bash')
  assert.deepEqual(p.args.slice(-1), ['echo started; sleep 600'])
  assert.equal(await sbx.commands.kill(h.pid), true)
  await assert.rejects(h.wait(), (e) => e instanceof CommandExitError && e.exitCode === 137 || e.exitCode === -1)
  assert.equal(await sbx.commands.kill(h.pid), false, 'killing a gone process reports false')
  assert.ok(!(await sbx.commands.list()).some((x) => x.pid === h.pid))
})

test('CommandHandle.wait returns the result of a background command', async () => {
  const h = await sbx.commands.run('sleep 0.2; echo done', { background: true })
  const r = await h.wait()
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'done\n')
  assert.equal(h.exitCode, 0)
})

test('CommandHandle.kill', async () => {
  const h = await sbx.commands.run('sleep 600', { background: true })
  assert.equal(await h.kill(), true)
  await assert.rejects(h.wait(), (e) => e instanceof CommandExitError)
})

test('CommandHandle.disconnect then commands.connect', async () => {
  const h = await sbx.commands.run('sleep 0.5; echo after', { background: true })
  await h.disconnect()
  const got = []
  const c = await sbx.commands.connect(h.pid, { onStdout: (d) => got.push(d) })
  assert.equal(c.pid, h.pid)
  const r = await c.wait()
  assert.equal(r.exitCode, 0)
  assert.equal(got.join(''), 'after\n')
  await assert.rejects(sbx.commands.connect(999999), (e) => e instanceof NotFoundError || /not found/i.test(e.message))
})

test('commands.sendStdin and closeStdin', async () => {
  const h = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'line one\n')
  await until(() => h.stdout === 'line one\n', 5000, 'echo of stdin')
  await h.sendStdin('line two\n')
  await sbx.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'line one\nline two\n')
})

// ---------------------------------------------------------------- PTY

function ptyCollector() {
  const dec = new TextDecoder()
  const c = { text: '', onData: (d) => { c.text += dec.decode(d, { stream: true }) } }
  return c
}
const enc = (s) => new TextEncoder().encode(s)

test('pty.create with size, sendInput', async () => {
  const out = ptyCollector()
  const h = await sbx.pty.create({ cols: 91, rows: 27, onData: out.onData, timeoutMs: 30_000 })
  assert.ok(h.pid > 0)
  await sbx.pty.sendInput(h.pid, enc('stty size; echo TTY=$(tty)\n'))
  await until(() => /27 91/.test(out.text) && /TTY=\/dev\/pts\//.test(out.text), 5000, 'stty size')
  await sbx.pty.sendInput(h.pid, enc('exit 0\n'))
  const r = await h.wait()
  assert.equal(r.exitCode, 0)
})

test('pty.resize', async () => {
  const out = ptyCollector()
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: out.onData, timeoutMs: 30_000 })
  await sbx.pty.resize(h.pid, { cols: 132, rows: 43 })
  await sbx.pty.sendInput(h.pid, enc('stty size\n'))
  await until(() => /43 132/.test(out.text), 5000, 'resized stty size')
  await sbx.pty.kill(h.pid)
})

test('pty.kill', async () => {
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {}, timeoutMs: 30_000 })
  assert.equal(await sbx.pty.kill(h.pid), true)
  await assert.rejects(h.wait(), (e) => e instanceof CommandExitError)
  assert.equal(await sbx.pty.kill(h.pid), false)
})

test('pty.connect to a running terminal', async () => {
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {}, timeoutMs: 30_000 })
  await h.disconnect()
  const out = ptyCollector()
  const c = await sbx.pty.connect(h.pid, { onData: out.onData, timeoutMs: 30_000 })
  assert.equal(c.pid, h.pid)
  await sbx.pty.sendInput(h.pid, enc('echo reconnected-$((6*7))\n'))
  await until(() => out.text.includes('reconnected-42'), 5000, 'output after pty.connect')
  await sbx.pty.kill(h.pid)
})
