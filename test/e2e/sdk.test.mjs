// End-to-end tests of SPACE with the unmodified e2b SDK. The Go test in
// this directory starts `space up` from the built binaries and runs this
// file with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY pointing at it.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, CommandExitError, AuthenticationError, NotFoundError } from 'e2b'

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
