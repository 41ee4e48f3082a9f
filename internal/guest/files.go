package guest

// The /files endpoints (envd's HTTP file API): what GET and POST share
// (errors, the request's user, paths) and GET /files, the download.
// POST is in upload.go.

import (
	"compress/gzip"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

const metadataHeaderPrefix = "X-Metadata-"

// fileEntry is one element of the POST /files response.
type fileEntry struct {
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Path     string            `json:"path"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// httpError is an error with the HTTP status envd would answer.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func httpErrorf(status int, format string, args ...any) *httpError {
	return &httpError{status: status, msg: fmt.Sprintf(format, args...)}
}

func writeHTTPError(w http.ResponseWriter, err error) {
	var he *httpError
	if errors.As(err, &he) {
		writeJSONError(w, he.status, he.msg)
		return
	}
	writeJSONError(w, http.StatusInternalServerError, err.Error())
}

// filesUser returns the account /files acts as: the username query
// parameter, else the Basic authorization user, else the default user.
//
// A signed URL (the SDK's uploadUrl/downloadUrl: signature and optional
// signature_expiration, verified against the access token before the request
// reaches the agent) acts as exactly the user its signature covers: the
// username parameter, "" standing for the default user as in envd. An
// Authorization header naming another user is refused: whoever holds the
// URL must not be able to widen it to root's files.
func (s *Server) filesUser(r *http.Request) (*account, *userDB, error) {
	q := r.URL.Query()
	name := q.Get("username")
	if q.Has("signature") {
		for _, k := range []string{"signature", "signature_expiration", "path", "username"} {
			if len(q[k]) > 1 {
				return nil, nil, httpErrorf(http.StatusUnauthorized, "signed URL has more than one %s parameter", k)
			}
		}
		if name == "" {
			name = s.act.Load().DefaultUser
		}
		if u, _, ok := r.BasicAuth(); ok && u != "" && u != name {
			return nil, nil, httpErrorf(http.StatusUnauthorized, "authorization names user %s but the URL is signed for user %s", quote(u), quote(name))
		}
	}
	if name == "" {
		if u, _, ok := r.BasicAuth(); ok && u != "" {
			name = u
		}
	}
	if name == "" {
		name = s.act.Load().DefaultUser
	}
	db, err := s.users()
	if err != nil {
		return nil, nil, httpErrorf(http.StatusInternalServerError, "error reading users: %v", err)
	}
	acct, err := db.lookup(name)
	if err != nil {
		return nil, nil, httpErrorf(http.StatusUnauthorized, "error looking up user %s: user: unknown user %s", quote(name), name)
	}
	return acct, db, nil
}

// fileHTTPError answers a filesystem error of /files with its class (see
// fsErrorClass) and a JSON body naming what failed.
func fileHTTPError(err error, what string) error {
	var he *httpError
	if errors.As(err, &he) {
		return he
	}
	status, _ := fsErrorClass(err)
	if status == http.StatusInsufficientStorage {
		return httpErrorf(status, "not enough disk space available")
	}
	return httpErrorf(status, "%s: %v", what, unwrapPathErr(err))
}

func resolveHTTPPath(p, home string) (string, error) {
	path, err := ResolvePath(p, home)
	if err != nil {
		return "", httpErrorf(http.StatusBadRequest, "%v", err)
	}
	return path, nil
}

// acceptGzip negotiates the response encoding. ok is false when neither
// identity nor gzip is acceptable.
func acceptGzip(h string) (gz, ok bool) {
	if strings.TrimSpace(h) == "" {
		return false, true
	}
	q := map[string]float64{}
	for _, part := range strings.Split(h, ",") {
		name, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		name = strings.ToLower(strings.TrimSpace(name))
		if name == "" {
			continue
		}
		v := 1.0
		if qs, ok := strings.CutPrefix(strings.TrimSpace(params), "q="); ok {
			if f, err := strconv.ParseFloat(qs, 64); err == nil {
				v = f
			}
		}
		q[name] = v
	}
	get := func(name string) float64 {
		if v, ok := q[name]; ok {
			return v
		}
		if v, ok := q["*"]; ok {
			return v
		}
		if name == "identity" {
			return 0.001
		}
		return 0
	}
	if get("gzip") > 0 {
		return true, true
	}
	return false, get("identity") > 0
}

// handleDownload serves GET /files?path=...&username=...
func (s *Server) handleDownload(w http.ResponseWriter, r *http.Request) {
	acct, _, err := s.filesUser(r)
	if err != nil {
		writeHTTPError(w, err)
		return
	}
	path, err := resolveHTTPPath(r.URL.Query().Get("path"), acct.Home)
	if err != nil {
		writeHTTPError(w, err)
		return
	}
	gz, ok := acceptGzip(r.Header.Get("Accept-Encoding"))
	if !ok {
		writeJSONError(w, http.StatusNotAcceptable, "no acceptable encoding found, supported: [identity, gzip]")
		return
	}
	// Stat and open as the user: the kernel decides whether they may read
	// the file. Reading the open file later needs no further permission.
	var (
		f  *os.File
		st fs.FileInfo
	)
	err = runAs(acct, func() error {
		var err error
		if st, err = os.Stat(path); err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return httpErrorf(http.StatusNotFound, "path %s does not exist", quote(path))
			}
			return fileHTTPError(err, "error checking path "+quote(path))
		}
		if st.IsDir() {
			return httpErrorf(http.StatusBadRequest, "path %s is a directory", quote(path))
		}
		if !st.Mode().IsRegular() {
			return httpErrorf(http.StatusBadRequest, "path %s is not a regular file", quote(path))
		}
		// O_NONBLOCK: a FIFO swapped in after the stat must not block the
		// open (it has no effect on regular files).
		if f, err = os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0); err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return httpErrorf(http.StatusNotFound, "path %s does not exist", quote(path))
			}
			return fileHTTPError(err, "error opening file "+quote(path))
		}
		if st, err = f.Stat(); err != nil || !st.Mode().IsRegular() {
			_ = f.Close()
			return httpErrorf(http.StatusBadRequest, "path %s is not a regular file", quote(path))
		}
		if acct.UID != 0 && agentProcFile(f) {
			_ = f.Close()
			return httpErrorf(http.StatusForbidden, "error opening file %s: %v", quote(path), syscall.EACCES)
		}
		return nil
	})
	if err != nil {
		writeHTTPError(w, fileHTTPError(err, "error opening file "+quote(path)))
		return
	}
	defer f.Close()
	name := filepath.Base(path)
	w.Header().Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": name}))
	w.Header().Add("Vary", "Accept-Encoding")
	if !gz || r.Header.Get("Range") != "" {
		http.ServeContent(w, r, name, st.ModTime(), f)
		return
	}
	ct := mime.TypeByExtension(filepath.Ext(name))
	if ct == "" {
		ct = "application/octet-stream"
	}
	w.Header().Set("Content-Type", ct)
	w.Header().Set("Content-Encoding", "gzip")
	w.Header().Set("Last-Modified", st.ModTime().UTC().Format(http.TimeFormat))
	zw := gzip.NewWriter(w)
	if _, err := io.Copy(zw, f); err != nil {
		s.log.Warn("download: copy failed", "path", path, "err", err)
		return
	}
	_ = zw.Close()
}

func unwrapPathErr(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// basicUser decodes the user of an "Authorization: Basic" header value.
func basicUser(v string) (string, bool) {
	enc, ok := strings.CutPrefix(v, "Basic ")
	if !ok {
		return "", false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(enc))
	if err != nil {
		return "", false
	}
	u, _, _ := strings.Cut(string(raw), ":")
	return u, true
}
