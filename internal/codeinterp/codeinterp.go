// Package codeinterp holds SPACE's code interpreter server, the program the
// code-interpreter-v1 template runs for @e2b/code-interpreter on port 49999
// (POST /execute streaming NDJSON, /contexts, /health; one Jupyter kernel
// per context; matplotlib figures as png plus the SDK's chart data).
//
// The server is Python (server/, on Debian's python3-jupyter-client,
// python3-ipykernel, matplotlib, pandas and numpy: no pip), embedded here so
// the image build writes it into the template's root file system with
// Install and the template starts and probes it with StartCommand and
// ReadyCommand. It runs as the sandbox's user; the HTTP API is what E2B's
// own server answers (see server/spaceci/http_api.py).
package codeinterp

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
)

// The patterns name the files themselves: a directory pattern would leave
// out __init__.py (a leading underscore) and would take in __pycache__.
//
//go:embed server/*.py server/spaceci/*.py
var files embed.FS

const (
	// Port is the port @e2b/code-interpreter sends requests to
	// (JUPYTER_PORT in the SDK).
	Port = 49999
	// InstallDir is where the image holds the server.
	InstallDir = "/opt/space/code-interpreter"
	// Python is the interpreter the server runs on: Debian's, which the
	// Jupyter packages are installed for (a python3 earlier on PATH, e.g.
	// a pyenv one, would not have them).
	Python = "/usr/bin/python3"
	// Entry is the server's main file inside InstallDir.
	Entry = "space_code_interpreter.py"
)

// Files returns the server's files, rooted at the install directory's top.
func Files() fs.FS {
	sub, err := fs.Sub(files, "server")
	if err != nil {
		panic(err) // the embedded tree is fixed at build time
	}
	return sub
}

// Install writes the server's files into dir (created if missing):
// directories 0755, files 0644, so the sandbox's user can read and run
// them and not change them.
func Install(dir string) error {
	return fs.WalkDir(Files(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		dst := filepath.Join(dir, filepath.FromSlash(p))
		if d.IsDir() {
			if err := os.MkdirAll(dst, 0o755); err != nil {
				return fmt.Errorf("install code interpreter: %w", err)
			}
			return os.Chmod(dst, 0o755)
		}
		data, err := fs.ReadFile(Files(), p)
		if err != nil {
			return err
		}
		if err := os.WriteFile(dst, data, 0o644); err != nil {
			return fmt.Errorf("install code interpreter: %w", err)
		}
		return os.Chmod(dst, 0o644) // WriteFile keeps an existing file's mode
	})
}

// ContentHash is the SHA-256 of the server's files (names and contents):
// part of the content ID of an image that holds them.
func ContentHash() string {
	h := sha256.New()
	_ = fs.WalkDir(Files(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := fs.ReadFile(Files(), p)
		if err != nil {
			return err
		}
		fmt.Fprintf(h, "%s\x00%d\x00", p, len(data))
		h.Write(data)
		return nil
	})
	return hex.EncodeToString(h.Sum(nil))
}

// StateFile keeps the contexts in the sandbox's files, so a server that
// starts again after a move (ns moves restart processes and keep files)
// lists them, each reporting at its next execution that its kernel
// restarted.
const StateFile = "/home/user/.cache/space-code-interpreter/contexts.json"

// StartCommand is the shell command the template runs (as user `user`, in
// /home/user) to start the server on Port.
func StartCommand() string {
	return fmt.Sprintf("%s %s --port %d --state-file %s", Python, path.Join(InstallDir, Entry), Port, StateFile)
}

// ReadyCommand is a shell command that exits 0 once GET /health answers
// 200 (urllib raises, so python exits 1, on anything else; its traceback
// is dropped). The platform runs it repeatedly until then.
func ReadyCommand() string {
	return fmt.Sprintf(`%s -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:%d/health", timeout=2)' 2>/dev/null`, Python, Port)
}
