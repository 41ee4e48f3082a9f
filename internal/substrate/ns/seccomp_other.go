//go:build linux && !amd64

package ns

import (
	"errors"
	"runtime"
)

func installSeccomp() error {
	return errors.New("seccomp filter is only implemented for amd64, not " + runtime.GOARCH)
}
