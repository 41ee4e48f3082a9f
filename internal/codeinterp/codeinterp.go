// Package codeinterp holds the code interpreter server that the
// code-interpreter-v1 template runs on port 49999, and how a template runs
// it.
//
// This is a stand-in with the contract's API (/work/contracts/i16/server.md)
// until the server helper's package replaces it at merge: its server
// answers GET /health and POST /execute with one NDJSON line.
package codeinterp

import (
	"embed"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// Port is where the server listens in the sandbox (the SDK's JUPYTER_PORT).
const Port = 49999

// InstallDir is where the image holds the server files.
const InstallDir = "/opt/space/code-interpreter"

//go:embed server
var files embed.FS

// Install writes the server files into dir (0755 directories, 0644 files).
func Install(dir string) error {
	sub, err := fs.Sub(files, "server")
	if err != nil {
		return err
	}
	return fs.WalkDir(sub, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		dst := filepath.Join(dir, p)
		if d.IsDir() {
			if err := os.MkdirAll(dst, 0o755); err != nil {
				return fmt.Errorf("codeinterp: %w", err)
			}
			return os.Chmod(dst, 0o755)
		}
		b, err := fs.ReadFile(sub, p)
		if err != nil {
			return err
		}
		if err := os.WriteFile(dst, b, 0o644); err != nil {
			return fmt.Errorf("codeinterp: %w", err)
		}
		return os.Chmod(dst, 0o644)
	})
}

// StartCommand is the shell command the template runs as user `user` in
// /home/user.
func StartCommand() string {
	return fmt.Sprintf("python3 %s/space_code_interpreter.py --port %d", InstallDir, Port)
}

// ReadyCommand exits 0 once the server answers GET /health with 200.
func ReadyCommand() string {
	return fmt.Sprintf(`python3 -c 'import urllib.request,sys; sys.exit(0 if urllib.request.urlopen("http://127.0.0.1:%d/health", timeout=2).status == 200 else 1)'`, Port)
}
