// End-to-end tests of SPACE with the unmodified e2b SDK. The Go test in
// this directory starts `space up` from the built binaries and runs this
// file with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at it.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import { Sandbox, CommandExitError, AuthenticationError, NotFoundError } from 'e2b'

// getVia sends GET path to the edge with the given Host header (the public
// URL form <port>-<id>.<domain>), as a client resolving that name would.
function getVia(edge, host, path) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: edge.hostname, port: edge.port, path, headers: { Host: host } }, (res) => {
      let text = ''
      res.setEncoding('utf8')
      res.on('data', (c) => (text += c))
      res.on('end', () => resolve({ status: res.statusCode, text }))
    })
    req.on('error', reject)
    req.end()
  })
}

for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[v]) throw new Error(`${v} must be set (run through go test ./test/e2e)`)
}

const created = []
after(async () => {
  for (const sbx of created) {
    try { await sbx.kill() } catch {}
  }
})

test('create, run, write, read, kill', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 120_000 })
  created.push(sbx)
  assert.match(sbx.sandboxId, /^[a-z0-9]+$/)

  const r = await sbx.commands.run('echo hello')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello\n')

  const who = await sbx.commands.run('id -un; pwd')
  assert.equal(who.stdout, 'user\n/home/user\n')

  await sbx.files.write('/home/user/greeting.txt', 'hi from the e2b sdk\n')
  const content = await sbx.files.read('/home/user/greeting.txt')
  assert.equal(content, 'hi from the e2b sdk\n')

  const cat = await sbx.commands.run('cat /home/user/greeting.txt')
  assert.equal(cat.stdout, 'hi from the e2b sdk\n')

  await assert.rejects(sbx.commands.run('exit 3'), (e) => e instanceof CommandExitError && e.exitCode === 3)

  assert.equal(await sbx.isRunning(), true)
  await sbx.kill()
  assert.equal(await sbx.isRunning(), false)
  await assert.rejects(Sandbox.connect(sbx.sandboxId), (e) => e instanceof NotFoundError || /not found/i.test(e.message))
})

test('missing file is NotFound', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 60_000 })
  created.push(sbx)
  await assert.rejects(sbx.files.read('/home/user/does-not-exist'), (e) => e instanceof NotFoundError)
})

test('wrong API key is rejected', async () => {
  await assert.rejects(
    Sandbox.create('base', { apiKey: 'e2b_' + '0'.repeat(40) }),
    (e) => e instanceof AuthenticationError,
  )
})

test('service port through getHost', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 60_000 })
  created.push(sbx)
  await sbx.files.write('/home/user/www/index.html', 'served from the sandbox\n')
  await sbx.commands.run('cd /home/user/www && exec python3 -m http.server 8000', { background: true })
  const host = sbx.getHost(8000)
  // the domain carries the edge's HTTPS port (direct-urls.test.mjs)
  assert.equal(host, `8000-${sbx.sandboxId}.${sbx.sandboxDomain}`)
  assert.match(sbx.sandboxDomain, /^localhost:\d+$/)
  const edge = new URL(process.env.E2B_SANDBOX_URL)
  let res
  for (let i = 0; i < 100; i++) {
    res = await getVia(edge, host, '/index.html')
    if (res.status === 200) break
    await new Promise((r) => setTimeout(r, 100))
  }
  assert.equal(res.status, 200)
  assert.equal(res.text, 'served from the sandbox\n')
  // A port nothing listens on is a gateway error, not someone else's service.
  const closed = await getVia(edge, sbx.getHost(8001), '/')
  assert.equal(closed.status, 502)
})
