// Command idleproc is the memory baseline of space-bench: the smallest Go
// process (runtime only, built like spaced-guest), idle until killed.
package main

import "time"

func main() {
	for {
		time.Sleep(time.Hour)
	}
}
