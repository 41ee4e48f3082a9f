// Lifecycle events, webhooks and sandbox logs, driven with the unmodified
// e2b SDK (create, pause, connect, setTimeout, kill) and read with plain
// fetch and the API key (the SDK has no calls for them). Webhook delivery
// itself is tested where loopback receivers are allowed
// (events_test.go, --webhook-allow-private); this platform runs without
// that flag, so a loopback URL must be refused. Run by e2e_test.go.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { Sandbox } from 'e2b'

const api = process.env.E2B_API_URL
const key = process.env.E2B_API_KEY
const run = randomBytes(4).toString('hex')
const created = []
const hooks = []
after(async () => {
  await Promise.all(created.map((s) => s.kill().catch(() => {})))
  await Promise.all(hooks.map((id) => call('DELETE', `/events/webhooks/${id}`).catch(() => {})))
})

async function call(method, path, body, apiKey = key) {
  const res = await fetch(`${api}${path}`, {
    method,
    headers: { 'X-API-Key': apiKey, ...(body ? { 'Content-Type': 'application/json' } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  })
  const text = await res.text()
  return { status: res.status, text, json: text ? JSON.parse(text) : undefined }
}

async function eventually(what, fn, ms = 20_000) {
  const end = Date.now() + ms
  for (;;) {
    const v = await fn()
    if (v) return v
    if (Date.now() > end) assert.fail(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 200))
  }
}

test('events: a lifecycle through the SDK is in the events API and the logs', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 120_000, metadata: { run } })
  created.push(sbx)
  const out = await sbx.commands.run('echo from-the-agent')
  assert.equal(out.exitCode, 0)
  assert.equal(await sbx.pause(), true)
  await Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 })
  await sbx.setTimeout(300_000)
  const want = ['created', 'paused', 'resumed', 'updated'].map((t) => `sandbox.lifecycle.${t}`)
  const evs = await eventually('events', async () => {
    const r = await call('GET', `/events/sandboxes/${sbx.sandboxId}?orderAsc=true&limit=100`)
    assert.equal(r.status, 200, r.text)
    return r.json.length >= want.length && r.json
  })
  assert.deepEqual(evs.map((e) => e.type), want)
  for (const e of evs) {
    assert.equal(e.sandboxId, sbx.sandboxId)
    assert.equal(e.version, 'v2')
    assert.match(e.id, /^[0-9a-f-]{36}$/)
    assert.ok(!Number.isNaN(Date.parse(e.timestamp)))
  }
  assert.equal(evs[0].eventData.sandbox_metadata.run, run)

  // Team events: newest first by default, paged.
  const team = await call('GET', '/events/sandboxes?limit=100')
  assert.equal(team.status, 200)
  const mine = team.json.filter((e) => e.sandboxId === sbx.sandboxId).map((e) => e.type)
  assert.deepEqual(mine, [...want].reverse())
  assert.equal((await call('GET', '/events/sandboxes?limit=101')).status, 400)

  // Logs: the platform's lines and the agent's, merged by time.
  // (The agent's lines depend on the platform's log level: this suite's
  // runs at warn; events_test.go checks them at debug.)
  const logs = await eventually('platform lines', async () => {
    const r = await call('GET', `/v2/sandboxes/${sbx.sandboxId}/logs?limit=1000`)
    assert.equal(r.status, 200, r.text)
    const l = r.json.logs
    return l.filter((x) => x.fields.source === 'platform').length >= 4 && l
  })
  for (const l of logs) assert.ok(['platform', 'agent'].includes(l.fields.source), JSON.stringify(l))
  const times = logs.map((l) => Date.parse(l.timestamp))
  assert.deepEqual(times, [...times].sort((a, b) => a - b))
  for (const l of logs) assert.ok(['debug', 'info', 'warn', 'error'].includes(l.level), JSON.stringify(l))
  const back = await call('GET', `/v2/sandboxes/${sbx.sandboxId}/logs?direction=backward&limit=1&search=sandbox`)
  assert.equal(back.json.logs.length, 1)
  assert.match(back.json.logs[0].message, /timeout set/)
  const v1 = await call('GET', `/sandboxes/${sbx.sandboxId}/logs?limit=3`)
  assert.equal(v1.status, 200)
  assert.equal(v1.json.logs.length, 3)
  assert.equal(typeof v1.json.logs[0].line, 'string')

  await sbx.kill()
  await eventually('killed event', async () => {
    const r = await call('GET', `/events/sandboxes/${sbx.sandboxId}?limit=1`)
    return r.json[0]?.type === 'sandbox.lifecycle.killed'
  })
  // Another key, no key: nothing.
  assert.equal((await call('GET', `/v2/sandboxes/${sbx.sandboxId}/logs`, undefined, 'e2b_' + '0'.repeat(40))).status, 401)
  assert.equal((await call('GET', '/v2/sandboxes/nosuchsandbox0000000/logs')).status, 404)
})

test('events: webhook registration, secrets never shown, private URLs refused', async () => {
  const secret = `secret-${run}`
  const body = { name: `hook-${run}`, url: `https://hooks.example.com/${run}`, enabled: true,
    events: ['sandbox.lifecycle.created', 'sandbox.lifecycle.killed'], signatureSecret: secret }
  const r = await call('POST', '/events/webhooks', body)
  assert.equal(r.status, 201, r.text)
  hooks.push(r.json.id)
  assert.ok(!r.text.includes(secret))
  assert.equal(r.json.name, body.name)
  assert.deepEqual(r.json.events, body.events)
  const got = await call('GET', `/events/webhooks/${r.json.id}`)
  assert.equal(got.status, 200)
  assert.ok(!got.text.includes(secret))
  const list = await call('GET', '/events/webhooks')
  assert.ok(list.json.some((h) => h.id === r.json.id))
  const patched = await call('PATCH', `/events/webhooks/${r.json.id}`, { enabled: false })
  assert.equal(patched.status, 200)
  assert.equal(patched.json.enabled, false)
  for (const url of ['http://127.0.0.1:9/x', 'http://localhost/x', 'http://169.254.169.254/latest', 'http://10.0.0.1/', 'http://[::1]/']) {
    const bad = await call('POST', '/events/webhooks', { ...body, url })
    assert.equal(bad.status, 400, `${url}: ${bad.text}`)
  }
  assert.equal((await call('POST', '/events/webhooks', { ...body, events: ['sandbox.lifecycle.nope'] })).status, 400)
  assert.equal((await call('DELETE', `/events/webhooks/${r.json.id}`)).status, 204)
  assert.equal((await call('GET', `/events/webhooks/${r.json.id}`)).status, 404)
  hooks.pop()
})
