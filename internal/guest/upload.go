package guest

// POST /files: uploads (multipart or raw body) written as the request's
// user, with envd's metadata headers.

import (
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"mime"
	"mime/multipart"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

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

// writeFile replaces path with the content of r, as the user: it writes a
// temporary file next to it, syncs it, sets mode (kept from an existing
// file, else 0644) and metadata, then renames it over path. The file and
// missing parent directories are created by the user, so they are theirs;
// where the user may not create them the kernel refuses and so do we.
// When the user may write an existing file but not its directory, the
// file is rewritten in place (as envd always does).
func (s *Server) writeFile(path string, r io.Reader, acct *account, md map[string]string) (err error) {
	dir := filepath.Dir(path)
	var (
		f   *os.File
		tmp string // the temporary file; "" when writing in place
	)
	err = runAs(acct, func() error {
		if err := ensureDirs(dir); err != nil {
			if errors.Is(err, syscall.ENOTDIR) {
				return httpErrorf(http.StatusBadRequest, "parent of %s is not a directory", quote(path))
			}
			return fileHTTPError(err, "error creating parent directories of "+quote(path))
		}
		mode := fs.FileMode(0o644)
		existed := "0"
		st, err := os.Stat(path)
		switch {
		case err == nil && st.IsDir():
			return httpErrorf(http.StatusBadRequest, "path %s is a directory", quote(path))
		case err == nil:
			mode = st.Mode().Perm()
			existed = "1"
		case !errors.Is(err, fs.ErrNotExist):
			return fileHTTPError(err, "error checking path "+quote(path))
		}
		// The temp name's first digit tells watchers whether the target
		// existed (dirWatch reports the rename into place as envd's in-place
		// write: create+write for a new file, write for an existing one).
		f, err = os.CreateTemp(dir, "."+filepath.Base(path)+".upload-"+existed+"*")
		if err == nil {
			tmp = f.Name()
			if err := f.Chmod(mode); err != nil {
				_ = f.Close()
				_ = os.Remove(tmp)
				return fileHTTPError(err, "error setting mode of "+quote(path))
			}
			return nil
		}
		if existed == "1" && st.Mode().IsRegular() && errors.Is(err, fs.ErrPermission) {
			if f, err = os.OpenFile(path, os.O_WRONLY|os.O_TRUNC|syscall.O_NONBLOCK, 0); err == nil {
				if acct.UID != 0 && agentProcFile(f) {
					_ = f.Close()
					return httpErrorf(http.StatusForbidden, "error writing %s: %v", quote(path), syscall.EACCES)
				}
				return nil
			}
		}
		return fileHTTPError(err, "error creating file "+quote(path))
	})
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			if tmp != "" {
				_ = runAs(acct, func() error { return os.Remove(tmp) })
			}
		}
	}()
	// The copy needs no identity: the file is open for writing.
	if _, err := io.Copy(fileWriter{f}, r); err != nil {
		var we *fileWriteError
		if errors.As(err, &we) {
			return fileHTTPError(we.err, "error writing "+quote(path))
		}
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return bodyError(err, "")
		}
		return httpErrorf(http.StatusBadRequest, "error reading upload of %s: %v", quote(path), err)
	}
	return runAs(acct, func() error {
		if err := f.Sync(); err != nil {
			return fileHTTPError(err, "error syncing "+quote(path))
		}
		name := tmp
		if name == "" {
			name = path
		}
		// Without metadata a file system lacking user xattrs is fine.
		if err := writeMetadata(name, md); err != nil && len(md) > 0 {
			return fileHTTPError(err, "error storing metadata of "+quote(path))
		}
		if err := f.Close(); err != nil {
			return fileHTTPError(err, "error writing "+quote(path))
		}
		if tmp != "" {
			if err := os.Rename(tmp, path); err != nil {
				return fileHTTPError(err, "error writing "+quote(path))
			}
		}
		return nil
	})
}

// fileWriter tells the file's write errors (the user's disk or quota is
// full: 507) from the request body's read errors (400) in io.Copy.
type fileWriter struct{ f *os.File }

type fileWriteError struct{ err error }

func (e *fileWriteError) Error() string { return e.err.Error() }
func (e *fileWriteError) Unwrap() error { return e.err }

func (w fileWriter) Write(p []byte) (int, error) {
	n, err := w.f.Write(p)
	if err != nil {
		return n, &fileWriteError{err}
	}
	return n, nil
}

func multipartReader(r io.Reader, boundary string) *multipart.Reader {
	return multipart.NewReader(r, boundary)
}
