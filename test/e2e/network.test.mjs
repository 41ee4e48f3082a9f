// e2b SDK compatibility: network options (allowInternetAccess, network.allowOut
// / denyOut / rules, updateNetwork) and secrets, against a simulated internet
// (SPACE_TEST_INET from e2e_test.go: hosts in a network namespace of the test's
// own, with HTTP, HTTPS and DNS servers). The platform runs with --egress=deny.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { Sandbox, Secret, SecretNotFoundError, CommandExitError, InvalidArgumentError } from 'e2b'

const inet = JSON.parse(process.env.SPACE_TEST_INET ?? 'null')
if (!inet) throw new Error('SPACE_TEST_INET must be set (run through go test ./test/e2e)')
const [h0, h1] = inet.hosts
const run = randomBytes(4).toString('hex')
const created = []
async function create(opts = {}) {
  const sbx = await Sandbox.create('base', { timeoutMs: 120_000, ...opts, metadata: { run } })
  created.push(sbx)
  await sbx.files.write('/tmp/inet-ca.pem', inet.caPEM)
  return sbx
}
after(async () => {
  await Promise.all(created.map((s) => s.kill().catch(() => {})))
})

// fetch runs curl in the sandbox: the body, or null when nothing answered.
async function fetchIn(sbx, url) {
  try {
    const r = await sbx.commands.run(`curl -sS --max-time 5 --cacert /tmp/inet-ca.pem '${url}'`)
    return r.stdout
  } catch (e) {
    if (e instanceof CommandExitError) return null
    throw e
  }
}

test('default (--egress=deny): no way out', async () => {
  const s = await create()
  assert.equal(await fetchIn(s, `http://${h0}/`), null)
})

test('allowInternetAccess: true reaches the internet', async () => {
  const s = await create({ allowInternetAccess: true })
  assert.equal(await fetchIn(s, `http://${h0}/`), `hello from ${h0}`)
  assert.equal(await fetchIn(s, `https://api.allowed.test/`), `hello from ${h1}`)
  assert.equal((await s.getInfo()).allowInternetAccess, true)
})

test('network.allowOut domains and wildcards win over denyOut 0.0.0.0/0', async () => {
  const network = { allowOut: ['*.allowed.test', `${h0}`], denyOut: ['0.0.0.0/0'] }
  const s = await create({ network })
  assert.equal(await fetchIn(s, 'https://api.allowed.test/'), `hello from ${h1}`)
  assert.equal(await fetchIn(s, 'https://deep.sub.allowed.test/'), `hello from ${h1}`)
  assert.equal(await fetchIn(s, `http://${h0}/`), `hello from ${h0}`)
  assert.equal(await fetchIn(s, 'https://denied.test/'), null, 'a name outside the list')
  assert.equal(await fetchIn(s, `http://${inet.hosts[2]}/`), null, 'an address outside the list')
  const info = await s.getInfo()
  assert.deepEqual(info.network.allowOut, network.allowOut)
  assert.deepEqual(info.network.denyOut, network.denyOut)
})

test('updateNetwork replaces the rules of a running sandbox at once', async () => {
  const s = await create({ allowInternetAccess: true })
  assert.equal(await fetchIn(s, `http://${h0}/`), `hello from ${h0}`)
  // Omitted fields are cleared: allowInternetAccess falls back to the
  // platform's default (deny here), so it is named again.
  await s.updateNetwork({ allowInternetAccess: true, denyOut: [`${h0}/32`] })
  assert.equal(await fetchIn(s, `http://${h0}/`), null)
  assert.equal(await fetchIn(s, `http://${h1}/`), `hello from ${h1}`)
  await Sandbox.updateNetwork(s.sandboxId, { allowInternetAccess: false })
  assert.equal(await fetchIn(s, `http://${h1}/`), null)
  await s.updateNetwork({ allowOut: ['api.allowed.test'] })
  assert.equal(await fetchIn(s, 'https://api.allowed.test/'), `hello from ${h1}`)
  // The name's address (learned from the platform's resolver) does not
  // carry another name: a request for denied.test sent to it is refused.
  await assert.rejects(s.commands.run(`curl -sS --max-time 5 -H 'Host: denied.test' http://${h1}/`), CommandExitError)
  await assert.rejects(s.updateNetwork({ allowOut: ['not a host!'] }), (e) => /400|invalid/i.test(e.message))
  await assert.rejects(Sandbox.updateNetwork('nosuchsandbox0000000', {}), (e) => /not found/i.test(e.message))
})

test('Secret: create, getInfo, list, update, destroy; values never returned', async () => {
  const name = `e2e-${run}`
  const info = await Secret.create(name, 'first-value', { metadata: { team: 'e2e' } })
  assert.equal(info.name, name)
  assert.equal(info.version, 1)
  assert.match(info.secretId, /^sec_/)
  assert.deepEqual((await Secret.getInfo(name)).metadata, { team: 'e2e' })
  assert.ok(await Secret.exists(info.secretId))
  const all = []
  const pages = Secret.list({ limit: 1 })
  while (pages.hasNext) all.push(...(await pages.nextItems()))
  assert.ok(all.some((s) => s.name === name))
  assert.ok(!JSON.stringify(all).includes('first-value'))
  assert.equal((await Secret.update(name, 'second-value')).version, 2)
  await assert.rejects(Secret.create(name, 'dup'), (e) => /409|exist/i.test(e.message))
  assert.equal(await Secret.destroy(name), true)
  assert.equal(await Secret.exists(name), false)
  await assert.rejects(Secret.getInfo(name), (e) => e instanceof SecretNotFoundError)
})

test('network.rules inject a secret into HTTPS requests; the sandbox holds only the placeholder', async () => {
  const name = `tok-${run}`
  await Secret.create(name, `value-${run}`)
  try {
    const s = await create({
      envs: { TOKEN: Secret.fill(name) },
      network: {
        allowOut: ['secret.test'], denyOut: ['0.0.0.0/0'],
        rules: { 'secret.test': [{ transform: { headers: { 'X-Api-Key': Secret.fill(name) } } }] },
      },
    })
    // The system trust store has the sandbox's egress CA.
    const r = await s.commands.run("curl -sS --max-time 5 https://secret.test/echo")
    assert.equal(JSON.parse(r.stdout).headers['X-Api-Key'][0], `value-${run}`)
    assert.equal((await s.commands.run('printf %s "$TOKEN"')).stdout, Secret.fill(name))
    const info = await s.getInfo()
    assert.equal(info.network.rules['secret.test'][0].transform.headers['X-Api-Key'], Secret.fill(name))
  } finally {
    await Secret.destroy(name)
  }
})

test('network options are checked: bad entries refused with 400, unknown secret with 404', async () => {
  await assert.rejects(create({ network: { allowOut: ['*'] } }), (e) => /400|invalid/i.test(e.message))
  await assert.rejects(create({ network: { denyOut: ['example.com'] } }), (e) => /400|invalid/i.test(e.message))
  await assert.rejects(
    create({ network: { allowOut: ['x.test'], rules: { 'x.test': [{ transform: { headers: { A: Secret.fill('nosuch') } } }] } } }),
    (e) => /404|not found/i.test(e.message))
  assert.throws(() => Secret.fill('{bad}'), InvalidArgumentError)
})
