// microVM sandboxes (template base-vm) with the unmodified e2b SDK: a
// background command keeps streaming its output to the same client
// connection while the sandbox moves to another worker (SPACE's migrate
// extension): the VM's memory snapshot keeps the process, and the edge
// reattaches the stream to it in the new execution. Run by e2e_test.go.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'

const api = process.env.E2B_API_URL
const key = process.env.E2B_API_KEY
const created = []
after(async () => {
  await Promise.all(created.map((s) => s.kill().catch(() => {})))
})

async function migrate(id) {
  const res = await fetch(`${api}/space/v1/sandboxes/${id}/migrate`, {
    method: 'POST',
    headers: { 'X-API-Key': key, 'Content-Type': 'application/json' },
    body: '{}',
  })
  const body = await res.json()
  assert.equal(res.status, 200, JSON.stringify(body))
  return body
}

async function until(fn, ms, what) {
  const end = Date.now() + ms
  for (;;) {
    const v = await fn()
    if (v) return v
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 50))
  }
}

test('microvm: a background command keeps streaming across a cross-worker move', async (t) => {
  let sbx
  try {
    sbx = await Sandbox.create('base-vm', { timeoutMs: 600_000 })
  } catch (e) {
    if (/microvm substrate/.test(e.message)) {
      t.skip(`no microvm substrate on this platform: ${e.message}`)
      return
    }
    throw e
  }
  created.push(sbx)
  assert.match(await sbx.commands.run('uname -r').then((r) => r.stdout), /cloud/)

  const seen = []
  const handle = await sbx.commands.run('i=0; while :; do i=$((i+1)); echo $i; sleep 0.2; done', {
    background: true,
    timeoutMs: 0,
    onStdout: (d) => {
      for (const l of d.split('\n')) if (l) seen.push(Number(l))
    },
  })
  await until(() => seen.length >= 5, 30_000, 'output before the move')
  const before = seen.length
  const last = seen[seen.length - 1]

  const moved = await migrate(sbx.sandboxId)
  assert.equal(moved.processes_restarted, false)
  assert.notEqual(moved.route.worker, moved.from.worker)

  // The same handle (same client connection) keeps receiving the same
  // process's output: the counter continues, it does not restart at 1.
  await until(() => seen.length >= before + 10, 60_000, 'output after the move')
  for (let i = 1; i < seen.length; i++) {
    assert.ok(seen[i] > seen[i - 1], `counter not increasing at ${i}: ${seen.slice(Math.max(0, i - 3), i + 3)}`)
  }
  assert.ok(seen[seen.length - 1] > last + 5)
  const procs = await sbx.commands.list()
  assert.ok(procs.some((p) => p.pid === handle.pid), `pid ${handle.pid} in ${JSON.stringify(procs.map((p) => p.pid))}`)
  const missed = seen[seen.length - 1] - seen[0] + 1 - seen.length
  t.diagnostic(`counter ${seen[0]}..${seen[seen.length - 1]}, ${seen.length} lines, ${missed} not delivered across the move`)
  await handle.kill()
})
