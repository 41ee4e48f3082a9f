// Direct sandbox URLs, as the SDK builds them when E2B_SANDBOX_URL is unset:
// https://<port>-<id>.<domain>, where <domain> is what the API returns
// ("localhost:<edge HTTPS port>"). Everything here goes through Node's own
// fetch and the unmodified SDK; the edge's certificate comes from the local
// CA `space up` made, trusted through NODE_EXTRA_CA_CERTS, and *.localhost
// resolves through the host's resolver (make localhost-names).
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'

const plainEdge = process.env.E2B_SANDBOX_URL
for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY', 'NODE_EXTRA_CA_CERTS']) {
  if (!process.env[v]) throw new Error(`${v} must be set (run through go test ./test/e2e)`)
}
// The SDK reads it at each construction: without it, every envd call of
// this file goes to the direct URL.
delete process.env.E2B_SANDBOX_URL

let sbx
before(async () => {
  sbx = await Sandbox.create('base', { timeoutMs: 120_000 })
})
after(async () => {
  await sbx?.kill()
})

async function json(res) {
  const text = await res.text()
  try {
    return JSON.parse(text)
  } catch {
    assert.fail(`not JSON (${res.status}): ${text}`)
  }
}

test('the SDK reaches envd over https://49983-<id>.<domain>', async () => {
  assert.match(sbx.sandboxDomain, /^localhost:\d+$/)
  assert.equal(sbx.envdApiUrl, `https://49983-${sbx.sandboxId}.${sbx.sandboxDomain}`)
  const r = await sbx.commands.run('echo direct')
  assert.equal(r.stdout, 'direct\n')
  await sbx.files.write('/home/user/d.txt', 'over tls')
  assert.equal(await sbx.files.read('/home/user/d.txt'), 'over tls')
  // Connect to the same sandbox by id: the domain comes back from the API.
  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal(again.getHost(1234), `1234-${sbx.sandboxId}.${sbx.sandboxDomain}`)
  assert.equal(await again.files.read('/home/user/d.txt'), 'over tls')
})

test('a server started in the sandbox answers at https://${sbx.getHost(8000)}', async () => {
  await sbx.files.write('/home/user/www/index.html', 'served over the direct url\n')
  await sbx.commands.run('cd /home/user/www && exec python3 -m http.server 8000', { background: true })
  const url = `https://${sbx.getHost(8000)}/index.html`
  assert.equal(new URL(url).hostname, `8000-${sbx.sandboxId}.localhost`)
  let res
  for (let i = 0; i < 100; i++) {
    res = await fetch(url)
    if (res.status === 200) break
    await new Promise((r) => setTimeout(r, 100))
  }
  assert.equal(res.status, 200)
  assert.equal(await res.text(), 'served over the direct url\n')
  // A port nothing listens on is a gateway error.
  assert.equal((await fetch(`https://${sbx.getHost(8001)}/`)).status, 502)
})

for (const user of ['user', 'root']) {
  for (const exp of [undefined, 120]) {
    test(`uploadUrl then downloadUrl as ${user}, ${exp ? 'with' : 'without'} expiration`, async () => {
      const path = `${user === 'root' ? '/root' : '/home/user'}/signed-${exp ?? 'none'}.txt`
      const opts = { user, useSignatureExpiration: exp }
      const up = new URL(await sbx.uploadUrl(path, opts))
      assert.equal(up.origin, `https://49983-${sbx.sandboxId}.${sbx.sandboxDomain}`)
      assert.equal(up.searchParams.get('username'), user)
      assert.equal(up.searchParams.has('signature_expiration'), exp !== undefined)
      const body = `written by ${user} through a signed url (${exp})`
      const fd = new FormData()
      fd.append('file', new Blob([body]), 'f.txt')
      const res = await fetch(up, { method: 'POST', body: fd })
      assert.equal(res.status, 200, await res.clone().text())
      const down = await sbx.downloadUrl(path, opts)
      const got = await fetch(down)
      assert.equal(got.status, 200)
      assert.equal(await got.text(), body)
      const owner = await sbx.commands.run(`stat -c %U ${path}`, { user: 'root' })
      assert.equal(owner.stdout.trim(), user)
    })
  }
}

test('expired and tampered signatures are 401 with envd\'s JSON body', async () => {
  await sbx.files.write('/home/user/guarded.txt', 'guarded')
  const expired = await fetch(await sbx.downloadUrl('/home/user/guarded.txt', { user: 'user', useSignatureExpiration: -10 }))
  assert.equal(expired.status, 401)
  assert.match(expired.headers.get('content-type'), /application\/json/)
  const eb = await json(expired)
  assert.equal(eb.code, 401)
  assert.equal(eb.message, 'signature is already expired')

  const good = new URL(await sbx.downloadUrl('/home/user/guarded.txt', { user: 'user', useSignatureExpiration: 60 }))
  const sig = good.searchParams.get('signature')
  const tampered = new URL(good)
  tampered.searchParams.set('signature', sig.slice(0, -1) + (sig.endsWith('A') ? 'B' : 'A'))
  const tb = await fetch(tampered)
  assert.equal(tb.status, 401)
  const tj = await json(tb)
  assert.equal(tj.code, 401)
  assert.equal(tj.message, 'invalid signature')
  // The same signature for another user, path or a later expiration.
  for (const [k, v] of [['username', 'root'], ['path', '/home/user/d.txt'], ['signature_expiration', String(Number(good.searchParams.get('signature_expiration')) + 600)]]) {
    const u = new URL(good)
    u.searchParams.set(k, v)
    const r = await fetch(u)
    assert.equal(r.status, 401, `${k}=${v}`)
    assert.equal((await json(r)).message, 'invalid signature')
  }
  // A read signature does not authorize a write.
  const fd = new FormData()
  fd.append('file', new Blob(['evil']), 'g.txt')
  assert.equal((await fetch(good, { method: 'POST', body: fd })).status, 401)
  assert.equal(await sbx.files.read('/home/user/guarded.txt'), 'guarded')
  // The untouched URL works.
  assert.equal(await (await fetch(good)).text(), 'guarded')
})

test('the edge refuses what addresses no sandbox of its domain', async () => {
  const port = sbx.sandboxDomain.split(':')[1]
  // An unknown sandbox: the control plane knows none (502, as E2B's proxy).
  const unknown = await fetch(`https://8000-ffffffffffffffffffff.localhost:${port}/`)
  assert.equal(unknown.status, 502)
  assert.equal((await json(unknown)).reason, 'sandbox_not_found')
  // A name that is not <port>-<id>.<domain>: no certificate, no request.
  await assert.rejects(fetch(`https://a.b.localhost:${port}/`))
  // Plain http on the HTTPS port is not served (Go's TLS server answers
  // a bare 400 and closes).
  const plain = await fetch(`http://8000-${sbx.sandboxId}.localhost:${port}/`)
  assert.equal(plain.status, 400)
  assert.match(await plain.text(), /HTTPS/)
  // The edge's own name without a sandbox: its certificate is valid, the
  // request names no sandbox.
  const bare = await fetch(`https://localhost:${port}/files`)
  assert.equal(bare.status, 400)
})

test('signed URLs the SDK builds on E2B_SANDBOX_URL work as they are', async () => {
  // No sandbox id in the URL, no sandbox headers: the edge learns the
  // sandbox from the signature.
  const viaPlain = await Sandbox.connect(sbx.sandboxId, { sandboxUrl: plainEdge })
  for (const [user, exp] of [['user', undefined], ['root', 60]]) {
    const path = `${user === 'root' ? '/root' : '/home/user'}/plain-${exp ?? 'none'}.txt`
    const up = new URL(await viaPlain.uploadUrl(path, { user, useSignatureExpiration: exp }))
    assert.equal(up.origin, new URL(plainEdge).origin)
    const fd = new FormData()
    fd.append('file', new Blob([`plain ${user}`]), 'p.txt')
    const res = await fetch(up, { method: 'POST', body: fd })
    assert.equal(res.status, 200, await res.clone().text())
    const got = await fetch(await viaPlain.downloadUrl(path, { user, useSignatureExpiration: exp }))
    assert.equal(got.status, 200)
    assert.equal(await got.text(), `plain ${user}`)
  }
  const expired = await fetch(await viaPlain.downloadUrl('/home/user/guarded.txt', { user: 'user', useSignatureExpiration: -10 }))
  assert.equal(expired.status, 401)
  assert.equal((await json(expired)).message, 'signature is already expired')
  const tampered = new URL(await viaPlain.downloadUrl('/home/user/guarded.txt', { user: 'user' }))
  tampered.searchParams.set('path', '/etc/shadow')
  const tb = await fetch(tampered)
  assert.equal(tb.status, 401)
  assert.deepEqual(await json(tb), { code: 401, message: 'invalid signature', reason: 'unauthorized' })
})

test('the plain edge (E2B_SANDBOX_URL) keeps serving alongside', async () => {
  const res = await fetch(new URL('/files?path=/home/user/d.txt', plainEdge), {
    headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983', 'X-Access-Token': sbx.envdAccessToken },
  })
  assert.equal(res.status, 200)
  assert.equal(await res.text(), 'over tls')
})
