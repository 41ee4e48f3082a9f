// e2b SDK compatibility: the Files API and the SDK's error classes, run
// against `space up` by e2e_test.go (E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY point at it). One test per SDK call; each asserts results.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import {
  Sandbox, FileType, FilesystemEventType,
  NotFoundError, FileNotFoundError, TimeoutError, AuthenticationError,
  InvalidArgumentError, SandboxError, SandboxNotFoundError,
} from 'e2b'

for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[v]) throw new Error(`${v} must be set (run through go test ./test/e2e)`)
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const dec = new TextDecoder()
const created = []
// sbx: shared sandbox for the Files tests (each test uses its own
// directory). Both are secure (an envd access token): the SDK's default.
let sbx
let secure // for signed URLs and token errors

before(async () => {
  ;[sbx, secure] = await Promise.all([
    Sandbox.create('base', { timeoutMs: 180_000 }),
    Sandbox.create('base', { timeoutMs: 180_000, secure: true }),
  ])
  created.push(sbx, secure)
})

after(async () => {
  await Promise.all(created.map((s) => s.kill().catch(() => {})))
})

// ---------------------------------------------------------------- read

test('files.read text', async () => {
  await sbx.files.write('/home/user/r/t.txt', 'héllo\nworld\n')
  const s = await sbx.files.read('/home/user/r/t.txt')
  assert.equal(typeof s, 'string')
  assert.equal(s, 'héllo\nworld\n')
  // relative paths resolve against the user's home
  assert.equal(await sbx.files.read('r/t.txt'), 'héllo\nworld\n')
})

test('files.read bytes', async () => {
  const bin = Uint8Array.from({ length: 256 }, (_, i) => i)
  await sbx.files.write('/home/user/r/b.bin', bin.buffer)
  const got = await sbx.files.read('/home/user/r/b.bin', { format: 'bytes' })
  assert.ok(got instanceof Uint8Array)
  assert.deepEqual(got, bin)
})

test('files.read blob', async () => {
  await sbx.files.write('/home/user/r/blob.txt', 'blob body')
  const b = await sbx.files.read('/home/user/r/blob.txt', { format: 'blob' })
  assert.ok(b instanceof Blob)
  assert.equal(b.size, 9)
  assert.equal(await b.text(), 'blob body')
})

test('files.read stream', async () => {
  const big = 'x'.repeat(300_000) + 'END'
  await sbx.files.write('/home/user/r/big.txt', big)
  const stream = await sbx.files.read('/home/user/r/big.txt', { format: 'stream' })
  assert.ok(stream instanceof ReadableStream)
  let text = ''
  for await (const chunk of stream) text += dec.decode(chunk, { stream: true })
  assert.equal(text.length, big.length)
  assert.ok(text.endsWith('END'))
})

test('files.read empty file', async () => {
  await sbx.commands.run('mkdir -p /home/user/r && : > /home/user/r/empty')
  assert.equal(await sbx.files.read('/home/user/r/empty'), '')
  assert.deepEqual(await sbx.files.read('/home/user/r/empty', { format: 'bytes' }), new Uint8Array(0))
})

// ---------------------------------------------------------------- write

test('files.write single text returns WriteInfo and creates parents', async () => {
  const info = await sbx.files.write('/home/user/w/a/b/c.txt', 'deep')
  assert.equal(info.name, 'c.txt')
  assert.equal(info.path, '/home/user/w/a/b/c.txt')
  assert.equal(info.type, FileType.FILE)
  const r = await sbx.commands.run('cat /home/user/w/a/b/c.txt; stat -c %U /home/user/w/a/b/c.txt')
  assert.equal(r.stdout, 'deep' + 'user\n')
  // overwrite truncates
  await sbx.files.write('/home/user/w/a/b/c.txt', 'x')
  assert.equal(await sbx.files.read('/home/user/w/a/b/c.txt'), 'x')
})

test('files.write many', async () => {
  const infos = await sbx.files.write([
    { path: '/home/user/wm/one.txt', data: 'one' },
    { path: '/home/user/wm/two.bin', data: new Uint8Array([1, 2, 3]).buffer },
    { path: '/home/user/wm/sub/three.txt', data: new Blob(['three']) },
  ])
  assert.equal(infos.length, 3)
  assert.deepEqual(infos.map((i) => i.path).sort(),
    ['/home/user/wm/one.txt', '/home/user/wm/sub/three.txt', '/home/user/wm/two.bin'])
  assert.equal(await sbx.files.read('/home/user/wm/one.txt'), 'one')
  assert.deepEqual(await sbx.files.read('/home/user/wm/two.bin', { format: 'bytes' }), new Uint8Array([1, 2, 3]))
  assert.equal(await sbx.files.read('/home/user/wm/sub/three.txt'), 'three')
  assert.deepEqual(await sbx.files.write([]), [])
})

test('files.write Blob and ReadableStream (octet-stream upload)', async () => {
  await sbx.files.write('/home/user/ws/blob.txt', new Blob(['from a blob']))
  assert.equal(await sbx.files.read('/home/user/ws/blob.txt'), 'from a blob')
  const stream = new ReadableStream({
    start(c) {
      c.enqueue(new TextEncoder().encode('chunk1-'))
      c.enqueue(new TextEncoder().encode('chunk2'))
      c.close()
    },
  })
  const info = await sbx.files.write('/home/user/ws/stream.txt', stream)
  assert.equal(info.path, '/home/user/ws/stream.txt')
  assert.equal(await sbx.files.read('/home/user/ws/stream.txt'), 'chunk1-chunk2')
})

test('files.write gzip and as root', async () => {
  await sbx.files.write('/home/user/wg/z.txt', 'zipped', { gzip: true })
  assert.equal(await sbx.files.read('/home/user/wg/z.txt', { gzip: true }), 'zipped')
  await sbx.files.write('/root/rootfile', 'r', { user: 'root' })
  const r = await sbx.commands.run('stat -c %U /root/rootfile', { user: 'root' })
  assert.equal(r.stdout, 'root\n')
})

// ---------------------------------------------------------------- list / exists / getInfo

test('files.list with depth', async () => {
  await sbx.files.write([
    { path: '/home/user/l/a.txt', data: 'a' },
    { path: '/home/user/l/d1/b.txt', data: 'bb' },
    { path: '/home/user/l/d1/d2/c.txt', data: 'ccc' },
  ])
  const one = await sbx.files.list('/home/user/l')
  assert.deepEqual(one.map((e) => e.name).sort(), ['a.txt', 'd1'])
  const d1 = one.find((e) => e.name === 'd1')
  assert.equal(d1.type, FileType.DIR)
  assert.equal(d1.path, '/home/user/l/d1')
  const a = one.find((e) => e.name === 'a.txt')
  assert.equal(a.type, FileType.FILE)
  assert.equal(a.size, 1)
  const two = await sbx.files.list('/home/user/l', { depth: 2 })
  assert.deepEqual(two.map((e) => e.path).sort(),
    ['/home/user/l/a.txt', '/home/user/l/d1', '/home/user/l/d1/b.txt', '/home/user/l/d1/d2'])
  const three = await sbx.files.list('/home/user/l', { depth: 3 })
  assert.ok(three.some((e) => e.path === '/home/user/l/d1/d2/c.txt'))
  await assert.rejects(sbx.files.list('/home/user/l', { depth: 0 }), InvalidArgumentError)
})

test('files.exists', async () => {
  await sbx.files.write('/home/user/e/yes.txt', 'y')
  assert.equal(await sbx.files.exists('/home/user/e/yes.txt'), true)
  assert.equal(await sbx.files.exists('/home/user/e'), true)
  assert.equal(await sbx.files.exists('/home/user/e/no.txt'), false)
})

test('files.write metadata, returned by getInfo and list (envd 0.6.2)', async () => {
  await sbx.files.write('/home/user/meta/m.txt', 'm', { metadata: { owner: 'agent-7', purpose: 'test' } })
  const info = await sbx.files.getInfo('/home/user/meta/m.txt')
  assert.deepEqual(info.metadata, { owner: 'agent-7', purpose: 'test' })
  const [e] = await sbx.files.list('/home/user/meta')
  assert.deepEqual(e.metadata, { owner: 'agent-7', purpose: 'test' })
})

test('files.getInfo entry fields', async () => {
  await sbx.files.write('/home/user/gi/f.txt', 'twelve bytes')
  await sbx.commands.run('chmod 640 /home/user/gi/f.txt && ln -s /home/user/gi/f.txt /home/user/gi/link')
  const before = Date.now()
  const f = await sbx.files.getInfo('/home/user/gi/f.txt')
  assert.equal(f.name, 'f.txt')
  assert.equal(f.type, FileType.FILE)
  assert.equal(f.path, '/home/user/gi/f.txt')
  assert.equal(f.size, 12)
  assert.equal(f.mode, 0o640)
  assert.equal(f.permissions, '-rw-r-----')
  assert.equal(f.owner, 'user')
  assert.equal(f.group, 'user')
  assert.ok(f.modifiedTime instanceof Date)
  assert.ok(Math.abs(f.modifiedTime.getTime() - before) < 60_000, `modifiedTime ${f.modifiedTime}`)
  assert.equal(f.symlinkTarget, undefined)
  const d = await sbx.files.getInfo('/home/user/gi')
  assert.equal(d.type, FileType.DIR)
  assert.equal(d.permissions[0], 'd')
  const l = await sbx.files.getInfo('/home/user/gi/link')
  assert.equal(l.symlinkTarget, '/home/user/gi/f.txt')
  assert.equal(l.name, 'link')
})

// ---------------------------------------------------------------- remove / rename / makeDir

test('files.remove file and directory', async () => {
  await sbx.files.write([{ path: '/home/user/rm/f', data: 'f' }, { path: '/home/user/rm/d/g', data: 'g' }])
  await sbx.files.remove('/home/user/rm/f')
  assert.equal(await sbx.files.exists('/home/user/rm/f'), false)
  await sbx.files.remove('/home/user/rm/d')
  assert.equal(await sbx.files.exists('/home/user/rm/d'), false)
  assert.equal(await sbx.files.exists('/home/user/rm'), true)
})

test('files.rename', async () => {
  await sbx.files.write('/home/user/mv/old.txt', 'moved')
  const info = await sbx.files.rename('/home/user/mv/old.txt', '/home/user/mv/new.txt')
  assert.equal(info.name, 'new.txt')
  assert.equal(info.path, '/home/user/mv/new.txt')
  assert.equal(info.type, FileType.FILE)
  assert.equal(await sbx.files.exists('/home/user/mv/old.txt'), false)
  assert.equal(await sbx.files.read('/home/user/mv/new.txt'), 'moved')
  await assert.rejects(sbx.files.rename('/home/user/mv/nope', '/home/user/mv/x'), FileNotFoundError)
})

test('files.makeDir true then false', async () => {
  assert.equal(await sbx.files.makeDir('/home/user/md/a/b'), true)
  const info = await sbx.files.getInfo('/home/user/md/a/b')
  assert.equal(info.type, FileType.DIR)
  assert.equal(info.owner, 'user')
  assert.equal(await sbx.files.makeDir('/home/user/md/a/b'), false)
})

// ---------------------------------------------------------------- watchDir

async function waitFor(pred, ms = 10_000) {
  const end = Date.now() + ms
  while (Date.now() < end) {
    if (pred()) return true
    await sleep(50)
  }
  return pred()
}

test('files.watchDir events (non-recursive) and onExit', async () => {
  await sbx.files.makeDir('/home/user/wd')
  const events = []
  let exited = null
  const h = await sbx.files.watchDir('/home/user/wd', (e) => events.push(e), {
    onExit: (err) => { exited = err ?? 'clean' },
  })
  await sbx.files.write('/home/user/wd/f.txt', 'one')
  await sbx.files.rename('/home/user/wd/f.txt', '/home/user/wd/g.txt')
  await sbx.files.remove('/home/user/wd/g.txt')
  const has = (name, type) => events.some((e) => e.name === name && e.type === type)
  assert.ok(await waitFor(() => has('g.txt', FilesystemEventType.REMOVE)), JSON.stringify(events))
  assert.ok(has('f.txt', FilesystemEventType.CREATE), JSON.stringify(events))
  assert.ok(has('f.txt', FilesystemEventType.WRITE), JSON.stringify(events))
  assert.ok(has('f.txt', FilesystemEventType.RENAME), JSON.stringify(events))
  await h.stop()
  assert.ok(await waitFor(() => exited !== null, 5_000))
})

test('files.watchDir recursive', async () => {
  await sbx.files.makeDir('/home/user/wr/sub')
  const events = []
  const h = await sbx.files.watchDir('/home/user/wr', (e) => events.push(e), { recursive: true, includeEntry: true })
  await sbx.files.write('/home/user/wr/sub/deep.txt', 'x')
  assert.ok(await waitFor(() => events.some((e) => e.name === 'sub/deep.txt' && e.type === FilesystemEventType.CREATE)),
    JSON.stringify(events))
  // includeEntry (envd 0.6.3): the event carries the entry's info
  const ev = events.find((e) => e.name === 'sub/deep.txt')
  assert.equal(ev.entry?.path, '/home/user/wr/sub/deep.txt')
  assert.equal(ev.entry?.type, FileType.FILE)
  await h.stop()
  await assert.rejects(sbx.files.watchDir('/home/user/no-such-dir', () => {}), FileNotFoundError)
})

// ---------------------------------------------------------------- signed URLs

// fetchEdge sends a URL the SDK built (http://<edge>/files?...) to the edge
// the way a client outside the SDK does: no access token, only the sandbox
// addressing headers E2B_SANDBOX_URL requires.
function fetchEdge(s, url, init = {}) {
  return fetch(url, {
    ...init,
    headers: { ...(init.headers ?? {}), 'E2b-Sandbox-Id': s.sandboxId, 'E2b-Sandbox-Port': '49983' },
  })
}

test('downloadUrl / uploadUrl without an access token are unsigned (and refused by a secure sandbox)', async () => {
  // SDK 2.x creates every sandbox through POST /v2/sandboxes, which is
  // always secure (E2B and SPACE alike); an SDK object without the token
  // builds unsigned URLs.
  assert.ok(sbx.envdAccessToken, 'the SDK default is a secure sandbox')
  await sbx.files.write('/home/user/u/plain.txt', 'plain')
  const tokenless = new Sandbox({ sandboxId: sbx.sandboxId, envdVersion: sbx.envdApi.version })
  const d = new URL(await tokenless.downloadUrl('/home/user/u/plain.txt'))
  assert.equal(d.pathname, '/files')
  assert.equal(d.searchParams.get('path'), '/home/user/u/plain.txt')
  assert.equal(d.searchParams.get('signature'), null)
  assert.equal((await fetchEdge(sbx, d)).status, 401)
  // with the token in the header, the same URL works
  const res = await fetchEdge(sbx, d, { headers: { 'X-Access-Token': sbx.envdAccessToken } })
  assert.equal(res.status, 200)
  assert.equal(await res.text(), 'plain')
  await assert.rejects(tokenless.downloadUrl('/x', { useSignatureExpiration: 60 }), InvalidArgumentError)
  await assert.rejects(tokenless.uploadUrl('/x', { useSignatureExpiration: 60 }), InvalidArgumentError)
})

test('downloadUrl signed, secure sandbox, no access token', async () => {
  await secure.files.write('/home/user/s/secret.txt', 'signed read')
  const u = new URL(await secure.downloadUrl('/home/user/s/secret.txt'))
  assert.match(u.searchParams.get('signature'), /^v1_[A-Za-z0-9+/]+$/)
  assert.equal(u.searchParams.get('signature_expiration'), null)
  const res = await fetchEdge(secure, u)
  assert.equal(res.status, 200)
  assert.equal(await res.text(), 'signed read')
  // the same URL without its signature is refused
  const bare = new URL(u)
  bare.searchParams.delete('signature')
  assert.equal((await fetchEdge(secure, bare)).status, 401)
  // a signature for another path is refused
  const other = new URL(u)
  other.searchParams.set('path', '/home/user/s/other.txt')
  assert.equal((await fetchEdge(secure, other)).status, 401)
  // a read signature does not authorize a write
  const fd = new FormData()
  fd.append('file', new Blob(['evil']), 'secret.txt')
  assert.equal((await fetchEdge(secure, u, { method: 'POST', body: fd })).status, 401)
  assert.equal(await secure.files.read('/home/user/s/secret.txt'), 'signed read')
})

test('uploadUrl signed with expiration, secure sandbox, no access token', async () => {
  const u = new URL(await secure.uploadUrl('/home/user/s/up.txt', { useSignatureExpiration: 120 }))
  const exp = Number(u.searchParams.get('signature_expiration'))
  assert.ok(exp > Date.now() / 1000 + 100 && exp < Date.now() / 1000 + 130, `expiration ${exp}`)
  const fd = new FormData()
  fd.append('file', new Blob(['uploaded via signed url']), 'up.txt')
  const res = await fetchEdge(secure, u, { method: 'POST', body: fd })
  assert.equal(res.status, 200, await res.clone().text())
  assert.equal(await secure.files.read('/home/user/s/up.txt'), 'uploaded via signed url')
  // a write signature does not authorize a read
  assert.equal((await fetchEdge(secure, u)).status, 401)
  // tampering with the expiration invalidates the signature
  const t = new URL(u)
  t.searchParams.set('signature_expiration', String(exp + 1000))
  assert.equal((await fetchEdge(secure, t, { method: 'POST', body: fd })).status, 401)
})

test('downloadUrl with an expired signature is 401', async () => {
  await secure.files.write('/home/user/s/exp.txt', 'x')
  const u = new URL(await secure.downloadUrl('/home/user/s/exp.txt', { useSignatureExpiration: -10 }))
  assert.ok(Number(u.searchParams.get('signature_expiration')) < Date.now() / 1000)
  assert.equal((await fetchEdge(secure, u)).status, 401)
})

// ---------------------------------------------------------------- errors

test('error: missing file is FileNotFoundError (read, getInfo, list, remove-then-read)', async () => {
  await assert.rejects(sbx.files.read('/home/user/missing.txt'), (e) => e instanceof FileNotFoundError && e instanceof NotFoundError)
  await assert.rejects(sbx.files.read('/home/user/missing.txt', { format: 'stream' }), FileNotFoundError)
  await assert.rejects(sbx.files.getInfo('/home/user/missing.txt'), FileNotFoundError)
  await assert.rejects(sbx.files.list('/home/user/missing-dir'), FileNotFoundError)
})

test('error: directory passed as file is InvalidArgumentError', async () => {
  await sbx.files.makeDir('/home/user/isdir')
  await assert.rejects(sbx.files.read('/home/user/isdir'), (e) => e instanceof InvalidArgumentError && /directory/i.test(e.message))
  await assert.rejects(sbx.files.write('/home/user/isdir', 'x'), (e) => e instanceof InvalidArgumentError && /directory/i.test(e.message))
})

test('error: file passed as directory to list is InvalidArgumentError', async () => {
  await sbx.files.write('/home/user/notdir.txt', 'x')
  await assert.rejects(sbx.files.list('/home/user/notdir.txt'), InvalidArgumentError)
})

test('error: bad API key is AuthenticationError', async () => {
  const bad = { apiKey: 'e2b_' + '1'.repeat(40) }
  await assert.rejects(Sandbox.list(bad).nextItems(), AuthenticationError)
  await assert.rejects(Sandbox.connect(sbx.sandboxId, bad), AuthenticationError)
  await assert.rejects(Sandbox.kill(sbx.sandboxId, bad), AuthenticationError)
})

test('error: bad or missing access token on a secure sandbox is AuthenticationError', async () => {
  const wrong = new Sandbox({ sandboxId: secure.sandboxId, envdVersion: secure.envdApi.version, envdAccessToken: 'not-the-token' })
  await assert.rejects(wrong.files.read('/home/user/s/secret.txt'), AuthenticationError)
  await assert.rejects(wrong.files.list('/home/user'), AuthenticationError)
  const none = new Sandbox({ sandboxId: secure.sandboxId, envdVersion: secure.envdApi.version })
  await assert.rejects(none.files.read('/home/user/s/secret.txt'), AuthenticationError)
  await assert.rejects(none.files.exists('/home/user'), AuthenticationError)
})

test('error: killed sandbox is TimeoutError for envd calls, NotFound for the API and commands', async () => {
  const s = await Sandbox.create('base', { timeoutMs: 60_000 })
  created.push(s)
  await s.files.write('/home/user/k.txt', 'k')
  await s.kill()
  await assert.rejects(s.files.read('/home/user/k.txt'), TimeoutError)
  await assert.rejects(s.files.write('/home/user/k.txt', 'x'), TimeoutError)
  await assert.rejects(s.files.list('/home/user'), TimeoutError)
  // A streaming RPC's start event fails with Unavailable: the SDK's
  // handleProcessStartEvent raises SandboxNotFoundError (as against E2B).
  await assert.rejects(s.commands.run('true'), SandboxNotFoundError)
  await assert.rejects(s.setTimeout(60_000), NotFoundError)
  await assert.rejects(Sandbox.connect(s.sandboxId), NotFoundError)
  assert.equal(await s.isRunning(), false)
  assert.equal(await s.kill(), false)
})

test('error: expired sandbox timeout is TimeoutError', async () => {
  const s = await Sandbox.create('base', { timeoutMs: 2_000 })
  created.push(s)
  await s.files.write('/home/user/t.txt', 'alive')
  assert.equal(await s.files.read('/home/user/t.txt'), 'alive')
  await sleep(3_500)
  await assert.rejects(s.files.read('/home/user/t.txt'), TimeoutError)
  await assert.rejects(s.files.list('/home/user'), TimeoutError)
  await assert.rejects(s.getInfo(), NotFoundError)
})

test('error: invalid arguments', async () => {
  // The API answers 400; the SDK raises its generic SandboxError (E2B's
  // handleApiError has no 400 mapping) carrying the status.
  await assert.rejects(Sandbox.create('base', { timeoutMs: -5_000 }),
    (e) => e instanceof SandboxError && e.name === 'SandboxError' && e.statusCode === 400)
  await assert.rejects(sbx.setTimeout(-5_000), (e) => e instanceof SandboxError && e.statusCode === 400)
  // envd RPC argument errors are InvalidArgumentError
  await assert.rejects(sbx.files.list('/home/user', { depth: -1 }), InvalidArgumentError)
})

// ---------------------------------------------------------------- git (deprecated SDK module over commands.run)

test('git: init, configureUser, add, commit, status, branches', async () => {
  const repo = '/home/user/repo'
  await sbx.git.init(repo, { initialBranch: 'main' })
  await sbx.git.configureUser('Space Test', 'test@example.com', { scope: 'local', path: repo })
  await sbx.files.write(`${repo}/a.txt`, 'a\n')
  let st = await sbx.git.status(repo)
  assert.equal(st.currentBranch, 'main')
  assert.equal(st.untrackedCount, 1)
  assert.equal(st.isClean, false)
  await sbx.git.add(repo, { all: true })
  await sbx.git.commit(repo, 'first')
  st = await sbx.git.status(repo)
  assert.equal(st.isClean, true)
  await sbx.git.createBranch(repo, 'feature')
  const br = await sbx.git.branches(repo)
  assert.equal(br.currentBranch, 'feature')
  assert.deepEqual([...br.branches].sort(), ['feature', 'main'])
  const log = await sbx.commands.run(`git -C ${repo} log --format=%s%x20%an`)
  assert.equal(log.stdout, 'first Space Test\n')
})
