package guest

import (
	"runtime"
	"sync"
)

// PrestartThreads makes the Go runtime create n OS threads now and keep
// them idle for later use (the runtime never exits an idle thread). In a
// sandbox whose pids limit a user's fork bomb can fill, a thread the agent
// needs later is then one it already has: the runtime aborts the whole
// process when it cannot create a thread.
func PrestartThreads(n int) {
	var locked, release sync.WaitGroup
	locked.Add(n)
	release.Add(1)
	var done sync.WaitGroup
	done.Add(n)
	for range n {
		go func() {
			defer done.Done()
			// A locked goroutine owns its thread: n of them blocked at once
			// need n threads. Unlocking before returning keeps the thread.
			runtime.LockOSThread()
			locked.Done()
			release.Wait()
			runtime.UnlockOSThread()
		}()
	}
	locked.Wait()
	release.Done()
	done.Wait()
}
