package guest

import (
	"compress/gzip"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"mime/multipart"
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

// filesUser returns the account for /files: the username query parameter,
// else the Basic authorization user, else the default user.
func (s *Server) filesUser(r *http.Request) (*account, *userDB, error) {
	name := r.URL.Query().Get("username")
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
	st, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		writeJSONError(w, http.StatusNotFound, fmt.Sprintf("path %s does not exist", quote(path)))
		return
	case err != nil:
		writeJSONError(w, http.StatusInternalServerError, fmt.Sprintf("error checking path %s: %v", quote(path), unwrapPathErr(err)))
		return
	case st.IsDir():
		writeJSONError(w, http.StatusBadRequest, fmt.Sprintf("path %s is a directory", quote(path)))
		return
	case !st.Mode().IsRegular():
		writeJSONError(w, http.StatusBadRequest, fmt.Sprintf("path %s is not a regular file", quote(path)))
		return
	}
	f, err := os.Open(path)
	if err != nil {
		writeJSONError(w, http.StatusInternalServerError, fmt.Sprintf("error opening file %s: %v", quote(path), unwrapPathErr(err)))
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

// uploadMetadata extracts X-Metadata-<key> headers (envd 0.6.2).
func uploadMetadata(h http.Header) (map[string]string, error) {
	md := map[string]string{}
	total := 0
	for k, vs := range h {
		if len(k) <= len(metadataHeaderPrefix) || !strings.EqualFold(k[:len(metadataHeaderPrefix)], metadataHeaderPrefix) || len(vs) == 0 {
			continue
		}
		key := strings.ToLower(k[len(metadataHeaderPrefix):])
		val := vs[0]
		if len(key) > maxMetadataKeyBytes {
			return nil, httpErrorf(http.StatusBadRequest, "metadata key %s is longer than %d bytes", quote(key), maxMetadataKeyBytes)
		}
		for i := 0; i < len(key); i++ {
			if key[i] < 0x21 || key[i] > 0x7e {
				return nil, httpErrorf(http.StatusBadRequest, "metadata key %s must be printable US-ASCII", quote(key))
			}
		}
		for i := 0; i < len(val); i++ {
			if val[i] < 0x20 || val[i] > 0x7e {
				return nil, httpErrorf(http.StatusBadRequest, "metadata value of key %s must be printable US-ASCII", quote(key))
			}
		}
		total += len(metadataXattrPrefix) + len(key) + len(val)
		md[key] = val
	}
	if total > maxMetadataTotalBytes {
		return nil, httpErrorf(http.StatusBadRequest, "metadata is larger than %d bytes", maxMetadataTotalBytes)
	}
	return md, nil
}

// handleUpload serves POST /files: multipart/form-data (parts named "file",
// the part's filename is the path unless ?path= is set) or
// application/octet-stream (?path= required), optionally gzip-encoded.
func (s *Server) handleUpload(w http.ResponseWriter, r *http.Request) {
	entries, err := s.upload(w, r)
	if err != nil {
		writeHTTPError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(entries)
}

func (s *Server) upload(w http.ResponseWriter, r *http.Request) ([]fileEntry, error) {
	acct, _, err := s.filesUser(r)
	if err != nil {
		return nil, err
	}
	md, err := uploadMetadata(r.Header)
	if err != nil {
		return nil, err
	}
	qpath := r.URL.Query().Get("path")
	var body io.Reader = http.MaxBytesReader(w, r.Body, s.cfg.MaxUploadBytes)
	switch enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))); enc {
	case "", "identity":
	case "gzip":
		zr, err := gzip.NewReader(body)
		if err != nil {
			return nil, bodyError(err, "invalid gzip body")
		}
		defer zr.Close()
		body = zr
	default:
		return nil, httpErrorf(http.StatusBadRequest, "unsupported content encoding %s", quote(enc))
	}
	ct, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		return nil, httpErrorf(http.StatusBadRequest, "invalid content type: %v", err)
	}
	switch ct {
	case "application/octet-stream":
		if qpath == "" {
			return nil, httpErrorf(http.StatusBadRequest, "path is required for application/octet-stream uploads")
		}
		path, err := resolveHTTPPath(qpath, acct.Home)
		if err != nil {
			return nil, err
		}
		if err := s.writeFile(path, body, acct, md); err != nil {
			return nil, err
		}
		return []fileEntry{{Name: filepath.Base(path), Type: "file", Path: path, Metadata: nilIfEmpty(md)}}, nil
	case "multipart/form-data":
		boundary := params["boundary"]
		if boundary == "" {
			return nil, httpErrorf(http.StatusBadRequest, "multipart body without boundary")
		}
		mr := multipartReader(body, boundary)
		var out []fileEntry
		for {
			part, err := mr.NextPart()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return nil, bodyError(err, "invalid multipart body")
			}
			_, dp, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
			if dp["name"] != "file" {
				_ = part.Close()
				continue
			}
			p := qpath
			if p == "" {
				// Not part.FileName(): it strips directories, and the SDK
				// sends the full destination path as the filename.
				p = dp["filename"]
			}
			if p == "" {
				return nil, httpErrorf(http.StatusBadRequest, "path is required (query parameter or part filename)")
			}
			path, err := resolveHTTPPath(p, acct.Home)
			if err != nil {
				return nil, err
			}
			if err := s.writeFile(path, part, acct, md); err != nil {
				return nil, err
			}
			out = append(out, fileEntry{Name: filepath.Base(path), Type: "file", Path: path, Metadata: nilIfEmpty(md)})
		}
		if len(out) == 0 {
			return nil, httpErrorf(http.StatusBadRequest, "no file part in multipart body")
		}
		return out, nil
	default:
		return nil, httpErrorf(http.StatusBadRequest, "unsupported content type %s", quote(ct))
	}
}

func nilIfEmpty(m map[string]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	return m
}

func bodyError(err error, what string) error {
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return httpErrorf(http.StatusRequestEntityTooLarge, "request body is larger than %d bytes", mbe.Limit)
	}
	return httpErrorf(http.StatusBadRequest, "%s: %v", what, err)
}

// writeFile atomically replaces path with the content of r: it writes a
// temporary file next to it, syncs it, sets owner (the user), mode (kept
// from an existing file, else 0644) and metadata, then renames it over path.
// Missing parent directories are created and owned by the user.
func (s *Server) writeFile(path string, r io.Reader, acct *account, md map[string]string) (err error) {
	dir := filepath.Dir(path)
	if err := ensureDirs(dir, acct.UID, acct.GID); err != nil {
		if errors.Is(err, syscall.ENOTDIR) {
			return httpErrorf(http.StatusBadRequest, "parent of %s is not a directory", quote(path))
		}
		return storageError(err, "error creating parent directories of "+quote(path))
	}
	mode := fs.FileMode(0o644)
	existed := "0"
	if st, err := os.Stat(path); err == nil {
		if st.IsDir() {
			return httpErrorf(http.StatusBadRequest, "path %s is a directory", quote(path))
		}
		mode = st.Mode().Perm()
		existed = "1"
	}
	// The temp name's first digit tells watchers whether the target
	// existed (dirWatch reports the rename into place as envd's in-place
	// write: create+write for a new file, write for an existing one).
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".upload-"+existed+"*")
	if err != nil {
		return storageError(err, "error creating file "+quote(path))
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err := io.Copy(tmp, r); err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return bodyError(err, "")
		}
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
			return storageError(err, "")
		}
		return httpErrorf(http.StatusBadRequest, "error reading upload of %s: %v", quote(path), err)
	}
	if err := tmp.Sync(); err != nil {
		return storageError(err, "error syncing "+quote(path))
	}
	if err := tmp.Chmod(mode); err != nil {
		return storageError(err, "error setting mode of "+quote(path))
	}
	if err := tmp.Chown(int(acct.UID), int(acct.GID)); err != nil && os.Getuid() == 0 {
		return storageError(err, "error setting owner of "+quote(path))
	}
	if err := writeMetadata(tmp.Name(), md); err != nil && len(md) > 0 {
		return storageError(err, "error storing metadata of "+quote(path))
	}
	if err := tmp.Close(); err != nil {
		return storageError(err, "error writing "+quote(path))
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return storageError(err, "error writing "+quote(path))
	}
	return nil
}

func storageError(err error, what string) error {
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return httpErrorf(http.StatusInsufficientStorage, "not enough disk space available")
	}
	return httpErrorf(http.StatusInternalServerError, "%s: %v", what, unwrapPathErr(err))
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

func multipartReader(r io.Reader, boundary string) *multipart.Reader {
	return multipart.NewReader(r, boundary)
}
