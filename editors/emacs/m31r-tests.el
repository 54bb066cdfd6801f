;;; m31r-tests.el --- ERT tests for m31r.el  -*- lexical-binding: t; -*-

;; Run from the repository root:
;;
;;   emacs -batch -L editors/emacs -l editors/emacs/m31r-tests.el -f ert-run-tests-batch-and-exit
;;
;; With M31R_LSP_CMD set (e.g. "m31r lsp --socket /path") and eglot
;; available, `m31r-eglot-roundtrip' also talks to that server.

;;; Code:

(require 'ert)
(require 'm31r)

(ert-deftest m31r-settings-defaults ()
  (should (equal (m31r-settings)
                 '(:enable t :debounceMs 75 :debounceMode "adaptive"
                   :multiline "auto" :deadlineMs 800 :maxTokens 64 :beams nil
                   :projectContext :json-false :minProbability 0.05 :socket ""))))

(ert-deftest m31r-settings-beams ()
  ;; nil is JSON null (the daemon's --beams), as eglot's jsonrpc serializes it.
  (should (string-match-p "\"beams\":null"
                          (json-serialize (m31r-settings) :null-object nil
                                          :false-object :json-false)))
  (let ((m31r-beams 2))
    (should (equal (plist-get (m31r-settings) :beams) 2))))

(ert-deftest m31r-socket-tilde-is-the-home-directory ()
  ;; The server is run without a shell: a literal ~ would name a folder.
  (let ((process-environment (cons "HOME=/tmp/m31r-home" process-environment))
        (m31r-socket "~/d.sock"))
    (should (equal (plist-get (m31r-settings) :socket) "/tmp/m31r-home/d.sock"))
    (should (equal (m31r-command) '("m31r" "lsp" "--socket" "/tmp/m31r-home/d.sock"))))
  (let ((m31r-socket "relative/~d.sock"))
    (should (equal (plist-get (m31r-settings) :socket) "relative/~d.sock"))
    (should (equal (m31r-command) '("m31r" "lsp" "--socket" "relative/~d.sock")))))

(ert-deftest m31r-settings-false-and-socket ()
  (let ((m31r-enable nil) (m31r-socket "/tmp/d.sock"))
    (should (eq (plist-get (m31r-settings) :enable) :json-false))
    (should (equal (plist-get (m31r-settings) :socket) "/tmp/d.sock"))
    (should (equal (m31r-command) '("m31r" "lsp" "--socket" "/tmp/d.sock"))))
  (should (equal (m31r-command) '("m31r" "lsp"))))

(ert-deftest m31r-modes ()
  (should (m31r--wanted-mode-p 'rust-mode))
  (should-not (m31r--wanted-mode-p 'python-mode))
  (let ((m31r-major-modes t))
    (should (m31r--wanted-mode-p 'emacs-lisp-mode))))

(ert-deftest m31r-mode-line-strings ()
  (let ((m31r-status nil) (m31r-enable t))
    (cl-letf (((symbol-function 'm31r--running-p) (lambda () t)))
      (should (equal (m31r-mode-line) ""))
      (m31r--set-status "ready" "tiny" 41.6)
      (should (equal (m31r-mode-line) "M31R 42ms"))
      (m31r--set-status "starting" nil nil)
      (should (equal (m31r-mode-line) "M31R starting"))
      (m31r--set-status "unavailable" nil nil)
      (should (equal (m31r-mode-line) "M31R unavailable"))
      (let ((m31r-enable nil))
        (should (equal (m31r-mode-line) "M31R off"))))
    ;; the last status of a server that has exited since
    (m31r--set-status "ready" "tiny" 41.6)
    (should (equal (m31r-mode-line) ""))))

(ert-deftest m31r-json-getter ()
  (let ((h (make-hash-table :test 'equal)))
    (puthash "state" "ready" h)
    (should (equal (m31r--get h "state") "ready")))
  (should (equal (m31r--get '(:state "ready") "state") "ready")))

;; This file's folder, which holds m31r.el and its README.
(defconst m31r-tests--dir (file-name-directory (or load-file-name buffer-file-name)))

(ert-deftest m31r-readme-lists-every-setting ()
  (let ((readme (with-temp-buffer
                  (insert-file-contents (expand-file-name "README.md" m31r-tests--dir))
                  (buffer-string))))
    (dolist (member (get 'm31r 'custom-group))
      (when (eq (cadr member) 'custom-variable)
        (should (string-match-p (regexp-quote (format "| `%s` |" (car member))) readme))))))

(ert-deftest m31r-eglot-registration ()
  (skip-unless (require 'eglot nil t))
  (let ((eglot-server-programs '((rust-mode . ("rust-analyzer")))))
    (m31r-eglot-setup)
    (m31r-eglot-setup)                  ; idempotent
    (should (equal (length eglot-server-programs) 2))
    (let ((entry (car eglot-server-programs)))
      (should (equal (car entry) m31r-major-modes))
      (let ((contact (funcall (cdr entry) nil)))
        (should (eq (car contact) 'm31r-eglot-server))
        (should (equal (seq-take (cdr contact) 2) '("m31r" "lsp")))
        (should (functionp (plist-get (cdddr contact) :initializationOptions)))))))

(ert-deftest m31r-eglot-roundtrip ()
  (let ((cmd (getenv "M31R_LSP_CMD")))
    (skip-unless (and cmd (not (string-empty-p cmd)) (require 'eglot nil t)))
    (let* ((dir (make-temp-file "m31r-eglot" t))
           (file (expand-file-name "lib.rs" dir))
           (m31r-major-modes '(m31r-test-rust-mode))
           (eglot-server-programs nil)
           (m31r-status nil)
           (m31r-beams 2))
      (define-derived-mode m31r-test-rust-mode prog-mode "Rust")
      (with-temp-file file
        (insert "fn main() {\n    let counts = 1;\n    \n}\n"))
      ;; Every suggestion shown (no confidence floor), sampled with a seed: a tiny test model's greedy
      ;; answer may be empty, a sampled one with this seed is not.
      (cl-letf* (((symbol-function 'm31r-command)
                  (lambda () (split-string-and-unquote cmd)))
                 (settings (symbol-function 'm31r-settings))
                 ((symbol-function 'm31r-settings)
                  (lambda ()
                    (append (plist-put (funcall settings) :minProbability 0)
                            '(:temperature 1.0 :seed 11 :multiline "always" :debounceMs 0)))))
        (m31r-eglot-setup)
        (with-current-buffer (find-file-noselect file)
          (m31r-test-rust-mode)
          (apply #'eglot (eglot--guess-contact))
          ;; eglot may finish connecting asynchronously.
          (dotimes (_ 300)
            (unless (eglot-current-server) (accept-process-output nil 0.1)))
          (let ((server (eglot-current-server)))
            (should server)
            (should (object-of-class-p server 'm31r-eglot-server))
            (should (member server (m31r--eglot-servers)))
            (goto-char (point-min))
            (forward-line 2)
            (end-of-line)
            (let ((res (jsonrpc-request
                        server :textDocument/inlineCompletion
                        (append (eglot--TextDocumentPositionParams)
                                (list :context (list :triggerKind 1))))))
              (let ((items (plist-get res :items)))
                (should (vectorp items))
                (should (= (length items) 1))
                (let ((text (plist-get (aref items 0) :insertText)))
                  (should (stringp text))
                  (should (> (length text) 0)))))
            ;; m31r-beams reaches the server, at start and when pushed; nil as null (the daemon's --beams).
            (cl-flet ((beams-is (want)
                        (cl-loop repeat 50
                                 for got = (plist-get
                                            (plist-get (jsonrpc-request server :m31r/stats
                                                                        (make-hash-table))
                                                       :settings)
                                            :beams)
                                 until (equal got want)
                                 do (accept-process-output nil 0.05)
                                 finally return got)))
              (should (equal (beams-is 2) 2))
              (setq m31r-beams 3)
              (m31r-push-settings)
              (should (equal (beams-is 3) 3))
              (setq m31r-beams nil)
              (m31r-push-settings)
              (should (equal (beams-is nil) nil)))
            (m31r-toggle -1)
            (m31r-toggle 1)
            (dotimes (_ 50) (unless m31r-status (accept-process-output nil 0.1)))
            (should (string-prefix-p "M31R" (m31r-mode-line)))
            (eglot-shutdown server)
            ;; no server: the mode line no longer shows the exited one's status
            (should (equal (m31r-mode-line) ""))))))))

(provide 'm31r-tests)
;;; m31r-tests.el ends here
